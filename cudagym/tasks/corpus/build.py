"""Building a corpus: compose, filter, write a parquet and a build report — resumably, in parallel.

The candidate stream for a seed is fixed: candidate `i` is `Composer.compose(seed, i)`, fitted to
the workload window and checked by the per-task filters, which are pure functions of the task.
Candidates are processed in shards of `shard_size` (one JSON file per shard under
`<out>/shards/`, written atomically), by `workers` processes. The result is the first `n`
candidates, in index order, that pass every filter, including the cross-task ones (`duplicate`,
`contamination`), which run in the main process over the contiguous prefix of finished shards.
So the parquet depends only on (config, seed, n, reference set), never on the number of
workers, on scheduling, or on a crash: a rerun reuses finished shards and redoes the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from cudagym.errors import ConfigError, TaskError
from cudagym.tasks.corpus.composer import Composer, ComposerConfig
from cudagym.tasks.corpus.contamination import ReferenceIndex
from cudagym.tasks.corpus.estimate import GpuSpec, estimate_workload, gpu_spec
from cudagym.tasks.corpus.filters import (
    FILTERS, Deduplicator, FilterConfig, FilterResult, check_runtime, check_workload, memory_problem,
)
from cudagym.tasks.model import CORPUS_SOURCE, Task

PARQUET_NAME = "tasks.parquet"
REPORT_NAME = "report.json"
SHARDS_DIR = "shards"
BUILD_NAME = "build.json"
FORMAT_VERSION = 1
MAX_BATCH = 16384


class BuildConfig(BaseModel):
    """Everything a build depends on (n and workers do not change which tasks come out)."""

    n: int = 6000
    seed: int = 0
    target_gpu: str = "h100"
    shard_size: int = 50
    workers: int = 1
    fit_workload: bool = True  # rescale BATCH by a power of two toward a draw inside the window
    data_source: str = CORPUS_SOURCE  # this one gives the tasks our own tolerances (`default_tolerance`)
    reference_bench: str | None = None
    max_candidates_factor: float = 20.0  # give up after n * factor candidates
    composer: ComposerConfig = Field(default_factory=ComposerConfig)
    filters: FilterConfig = Field(default_factory=FilterConfig)

    def shard_fingerprint(self) -> str:
        """What a shard's content depends on: the per-task parts of the config."""
        part = self.model_dump(include={"seed", "target_gpu", "shard_size", "fit_workload", "composer", "filters"})
        part["filters"].pop("contamination_threshold", None)
        part["version"] = FORMAT_VERSION
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]


# -- one candidate, one shard (worker side) ------------------------------------------------------
def task_id(seed: int, index: int) -> str:
    return f"ops_s{seed}_{index:06d}"


def _fit_batch(code: str, cpu_sizes: dict[str, int], gpu: GpuSpec, cfg: BuildConfig, index: int) -> tuple[str, Any]:
    """Rescale BATCH by a power of two toward a log-uniform draw in the window; cap memory."""
    est = estimate_workload(code, gpu)
    task = Task(id="fit", code=code, cpu_sizes=dict(cpu_sizes))
    batch = task.sizes.get("BATCH")
    if not cfg.fit_workload or not isinstance(batch, int) or est.est_ms <= 0:
        return code, est
    rng = random.Random(f"cudagym-ops-fit:{cfg.seed}:{index}")
    lo, hi = cfg.filters.min_ms, cfg.filters.max_ms
    target = math.exp(rng.uniform(math.log(lo * 2), math.log(hi / 2)))
    new = int(min(MAX_BATCH, max(1, 2 ** round(math.log2(batch * target / est.est_ms)))))
    for _ in range(12):
        if new != batch:
            code = task.resized(BATCH=new).code
            est = estimate_workload(code, gpu)
            batch = new
        if memory_problem(est, gpu, cfg.filters) is None or batch == 1:
            break
        new = max(1, batch // 2)
    return code, est


def process_candidate(composer: Composer, cfg: BuildConfig, gpu: GpuSpec, index: int) -> dict[str, Any]:
    """Compose candidate `index` and run the per-task filters; a JSON-able record."""
    composed = composer.compose(cfg.seed, index)
    if composed is None:
        return {"index": index, "filter": "compose", "reason": "no chain fits", "ops": []}
    rec: dict[str, Any] = {"index": index, "ops": composed.ops}
    try:
        code, est = _fit_batch(composed.code, composed.cpu_sizes, gpu, cfg, index)
    except TaskError as e:
        return rec | {"filter": "workload", "reason": str(e)[:300]}
    result = check_workload(est, gpu, cfg.filters)
    if result.ok:
        task = Task(id=task_id(cfg.seed, index), code=code, cpu_sizes=dict(composed.cpu_sizes), ops=composed.ops)
        result = check_runtime(task, cfg.filters)
    if not result.ok:
        return rec | {"filter": result.filter, "reason": result.reason}
    return rec | {"filter": None, "code": code, "cpu_sizes": composed.cpu_sizes, "flops": est.flops,
                  "bytes": est.bytes, "est_ms": est.est_ms, "memory_bytes": est.memory_bytes}


_WORKER: dict[str, Any] = {}


def _worker_init(cfg_json: str) -> None:
    import torch

    torch.set_num_threads(1)
    cfg = BuildConfig.model_validate_json(cfg_json)
    _WORKER.update(cfg=cfg, composer=Composer(cfg.composer), gpu=gpu_spec(cfg.target_gpu))


def process_shard(shard: int) -> list[dict[str, Any]]:
    """Every candidate of shard `shard` (in a worker initialized by `_worker_init`)."""
    import warnings

    cfg: BuildConfig = _WORKER["cfg"]
    start = shard * cfg.shard_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [process_candidate(_WORKER["composer"], cfg, _WORKER["gpu"], i)
                for i in range(start, start + cfg.shard_size)]


# -- the main process --------------------------------------------------------------------------
class _Merger:
    """Consumes shard records in index order: dedup, contamination, stop at n kept."""

    def __init__(self, cfg: BuildConfig, reference: ReferenceIndex | None) -> None:
        self.cfg, self.reference = cfg, reference
        self.dedup = Deduplicator()
        self.kept: list[dict[str, Any]] = []
        self.removed = {f: 0 for f in FILTERS}
        self.examples: dict[str, list[str]] = {f: [] for f in FILTERS}
        self.candidates = 0
        self.next_shard = 0

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.cfg.n

    def _remove(self, rec: dict[str, Any], result: FilterResult | None = None) -> None:
        f: str = (result.filter or "") if result else rec["filter"]
        reason = result.reason if result else rec.get("reason", "")
        self.removed[f] += 1
        if len(self.examples[f]) < 5:
            self.examples[f].append(f"{task_id(self.cfg.seed, rec['index'])} {'+'.join(rec.get('ops', []))}: {reason}")

    def feed(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            if self.done:
                return
            self.candidates += 1
            if rec["filter"] is not None:
                self._remove(rec)
                continue
            tid = task_id(self.cfg.seed, rec["index"])
            dup = self.dedup.check(tid, rec["code"])
            if not dup.ok:
                self._remove(rec, dup)
                continue
            nearest, score = None, None
            if self.reference is not None:
                match = self.reference.nearest(rec["code"])
                nearest, score = match.file, match.score
                if match.file is not None and match.score >= self.cfg.filters.contamination_threshold:
                    self._remove(rec, FilterResult.removed(
                        "contamination", f"similarity {match.score:.3f} to {match.file}"))
                    continue
            self.kept.append(rec | {"id": tid, "nearest_bench_file": nearest, "bench_similarity": score})


def _shard_path(out: Path, shard: int) -> Path:
    return out / SHARDS_DIR / f"shard_{shard:06d}.json"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prepare_out(out: Path, cfg: BuildConfig) -> None:
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    meta_path = out / BUILD_NAME
    fp = cfg.shard_fingerprint()
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old.get("shard_fingerprint") != fp:
            raise ConfigError(f"{out} holds shards of a different build (seed/config changed); "
                              f"use another --out or delete {out / SHARDS_DIR}")
    _write_atomic(meta_path, json.dumps({"shard_fingerprint": fp, "config": cfg.model_dump()}, indent=1))


def build_corpus(cfg: BuildConfig, out: str | Path, *, console: Any = None, progress: bool = True) -> dict[str, Any]:
    """Build (or resume) a corpus in `out`; returns the report (also written to report.json)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    out = Path(out)
    gpu_spec(cfg.target_gpu)  # an unknown GPU fails here, before any work
    if cfg.n < 1:
        raise ConfigError("n must be at least 1")
    _prepare_out(out, cfg)
    t0 = time.perf_counter()
    reference = None
    if cfg.reference_bench:
        try:
            reference = ReferenceIndex.from_dir(cfg.reference_bench, threshold=cfg.filters.contamination_threshold)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    merger = _Merger(cfg, reference)
    max_shards = math.ceil(cfg.n * cfg.max_candidates_factor / cfg.shard_size)
    results: dict[int, list[dict[str, Any]]] = {}
    reused = 0

    def load_done(shard: int) -> list[dict[str, Any]] | None:
        p = _shard_path(out, shard)
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())["records"]
        except (ValueError, KeyError):
            return None  # a torn file from a crash cannot happen (atomic rename), but be safe

    def advance() -> None:
        while not merger.done and merger.next_shard in results:
            merger.feed(results.pop(merger.next_shard))
            merger.next_shard += 1

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        kept_bar = bar.add_task("tasks kept", total=cfg.n)
        cand_bar = bar.add_task("candidates", total=None)
        executor = None
        inflight: dict[Future, int] = {}
        next_submit = 0
        try:
            while not merger.done:
                # reuse finished shards first, in order
                while next_submit < max_shards and not merger.done:
                    done = load_done(next_submit)
                    if done is None:
                        break
                    results[next_submit] = done
                    reused += 1
                    next_submit += 1
                    advance()
                if merger.done:
                    break
                if cfg.workers <= 1:
                    if next_submit >= max_shards:
                        break
                    if not _WORKER or _WORKER.get("cfg") != cfg:
                        _worker_init(cfg.model_dump_json())
                    recs = process_shard(next_submit)
                    _write_atomic(_shard_path(out, next_submit), json.dumps({"records": recs}))
                    results[next_submit] = recs
                    next_submit += 1
                else:
                    if executor is None:
                        import multiprocessing as mp

                        executor = ProcessPoolExecutor(cfg.workers, mp_context=mp.get_context("spawn"),
                                                       initializer=_worker_init, initargs=(cfg.model_dump_json(),))
                    while len(inflight) < 2 * cfg.workers and next_submit < max_shards:
                        if load_done(next_submit) is not None:
                            break  # handled by the reuse loop above
                        inflight[executor.submit(process_shard, next_submit)] = next_submit
                        next_submit += 1
                    if not inflight:
                        if next_submit >= max_shards:
                            break
                        continue
                    finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                    for fut in finished:
                        shard = inflight.pop(fut)
                        recs = fut.result()
                        _write_atomic(_shard_path(out, shard), json.dumps({"records": recs}))
                        results[shard] = recs
                advance()
                bar.update(kept_bar, completed=len(merger.kept))
                bar.update(cand_bar, completed=merger.candidates)
        finally:
            if executor is not None:
                for fut in inflight:
                    fut.cancel()
                executor.shutdown(wait=True, cancel_futures=True)
        bar.update(kept_bar, completed=len(merger.kept))
        bar.update(cand_bar, completed=merger.candidates)

    write_parquet(merger.kept, cfg, out / PARQUET_NAME)
    report = _report(cfg, merger, reference, reused, time.perf_counter() - t0)
    _write_atomic(out / REPORT_NAME, json.dumps(report, indent=1))
    return report


# -- outputs -----------------------------------------------------------------------------------
def _schema():  # noqa: ANN202
    import pyarrow as pa

    return pa.schema([
        ("ops", pa.list_(pa.string())), ("data_source", pa.string()), ("code", pa.string()),
        ("id", pa.string()), ("seed", pa.int64()), ("index", pa.int64()), ("level", pa.int64()),
        ("dtype", pa.string()), ("flops", pa.int64()), ("bytes", pa.int64()), ("est_ms", pa.float64()),
        ("target_gpu", pa.string()), ("cpu_sizes", pa.string()),
        ("nearest_bench_file", pa.string()), ("bench_similarity", pa.float64()),
    ])


def write_parquet(kept: list[dict[str, Any]], cfg: BuildConfig, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{
        "ops": r["ops"], "data_source": cfg.data_source, "code": r["code"], "id": r["id"], "seed": cfg.seed,
        "index": r["index"], "level": len(r["ops"]), "dtype": cfg.composer.dtype, "flops": r["flops"],
        "bytes": r["bytes"], "est_ms": r["est_ms"], "target_gpu": cfg.target_gpu,
        "cpu_sizes": json.dumps(r["cpu_sizes"], sort_keys=True),
        "nearest_bench_file": r["nearest_bench_file"], "bench_similarity": r["bench_similarity"],
    } for r in kept]
    table = pa.Table.from_pylist(rows, schema=_schema())
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {f"p{q}": round(v[min(len(v) - 1, int(q / 100 * len(v)))], 4) for q in (0, 10, 50, 90, 100)}


def _report(cfg: BuildConfig, merger: _Merger, reference: ReferenceIndex | None, reused: int,
            wall_s: float) -> dict[str, Any]:
    ops: dict[str, int] = {}
    counts: dict[str, int] = {}
    for r in merger.kept:
        for o in r["ops"]:
            ops[o] = ops.get(o, 0) + 1
        counts[str(len(r["ops"]))] = counts.get(str(len(r["ops"])), 0) + 1
    return {
        "n_requested": cfg.n, "n_built": len(merger.kept), "seed": cfg.seed, "target_gpu": cfg.target_gpu,
        "candidates": merger.candidates, "removed": merger.removed, "removed_examples": merger.examples,
        "op_histogram": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "op_count_histogram": dict(sorted(counts.items())),
        "est_ms": _quantiles([r["est_ms"] for r in merger.kept]),
        "reference": None if reference is None else {
            "path": cfg.reference_bench, "files": len(reference), "fingerprint": reference.fingerprint,
            "threshold": cfg.filters.contamination_threshold, **reference.stats},
        "shards_reused": reused, "shards_used": merger.next_shard, "workers": cfg.workers,
        "wall_s": round(wall_s, 1), "config": cfg.model_dump(),
    }


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The build report as rich tables: removed per filter, op-count and op histograms."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"corpus build: {report['n_built']}/{report['n_requested']} tasks from "
                    f"{report['candidates']} candidates (seed {report['seed']}, {report['target_gpu']}, "
                    f"{report.get('wall_s', 0)} s)")
    t.add_column("filter")
    t.add_column("removed", justify="right")
    t.add_column("share of candidates", justify="right")
    for f, k in report["removed"].items():
        t.add_row(f, str(k), f"{100 * k / max(1, report['candidates']):.1f}%")
    t.add_row("[bold]kept", f"[bold]{report['n_built']}",
              f"{100 * report['n_built'] / max(1, report['candidates']):.1f}%")
    console.print(t)
    h = Table(title="ops per task")
    h.add_column("ops")
    h.add_column("tasks", justify="right")
    h.add_column("share", justify="right")
    for k, v in report["op_count_histogram"].items():
        h.add_row(k, str(v), f"{100 * v / max(1, report['n_built']):.1f}%")
    console.print(h)
    o = Table(title=f"operator histogram ({len(report['op_histogram'])} ops used; top 25)")
    o.add_column("op")
    o.add_column("uses", justify="right")
    for name, v in list(report["op_histogram"].items())[:25]:
        o.add_row(name, str(v))
    console.print(o)
    if report.get("est_ms"):
        console.print(f"estimated eager ms on {report['target_gpu']}: {report['est_ms']}")
