"""The half-precision GEMM family's baselines, offline and in server mode, with their spread
over separate jobs; and the WMMA solution (`examples/gemm/model_new.py`) against all of them.

Protocol (one process, one `Evaluator` with the default config but for the timing below):
1. Configurations: `gemm_configs(--configs, --seed)`, the family's own draw (five shape
   classes, aligned and unaligned, fp16 and bf16 alternating), sizes as drawn.
2. Per configuration, `--jobs` (3) separate baseline jobs offline (calls back to back), then
   `--jobs` in server mode (each call after an idle gap drawn from `--server-gaps` ms, at most
   the evaluator's `server_calls` timed calls): each job is a fresh worker that times eager
   (`torch.matmul`), torch.compile, cuBLASLt with its heuristic and cuBLASLt autotuned
   (`cudagym.sandbox.library`), one after another, as the evaluator's cached baselines are
   measured (`Evaluator.ameasure_baselines`, past the cache). Timing: `--target-ms` of timed
   calls per role after `--warmup-ms` of warm-up (the protocol's defaults are 300 and 100; the
   shorter loop keeps 50 configurations x 6 jobs inside the GPU machine's time).
3. The WMMA solution on `--wmma` configurations (every other one of the first 2 x `--wmma`: with
   the default 10, each shape class aligned and unaligned, fp16 and bf16): `aevaluate` with
   server mode on, so each gets offline and server times against every baseline.

Printed (stdout): per configuration, each baseline's median over the jobs (the mean of the
jobs' medians) and its spread (max - min over the mean of the jobs' medians), offline and in
server mode; then the ratios against torch.matmul (the named baseline, measured in the same
jobs), their geomean per shape class; then the WMMA table. Progress goes to stderr; `--out`
gets every job's medians, rewritten after every configuration. A run resumes from `--out`
(configurations already measured are kept), so a budget (`--budget-s`) can split it across
calls: the run stops between configurations once the next would likely pass it.

Usage: python benchmarks/bench_gemm.py [--configs 50] [--seed 0] [--jobs 3] [--server-gaps 0.5,5]
           [--wmma 10] [--budget-s 540] [--out FILE.json] [--only-wmma] [--cache-dir DIR] [--report-only]
GPU (the cuBLASLt baselines need nvmath-python: pip install 'cudagym[gemm]'). CPU smoke run:
python benchmarks/bench_gemm.py --target cpu --configs 2 --jobs 2 --wmma 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.library import LIBRARY_TITLES
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.gemm import SHAPE_CLASSES, GemmConfig, gemm_configs, gemm_task

WMMA = Path(__file__).resolve().parent.parent / "examples" / "gemm" / "model_new.py"
BASELINES = ("eager", "compiled", "cublaslt", "cublaslt_tuned")
TITLES = {"eager": "torch.matmul", "compiled": "torch.compile", **LIBRARY_TITLES}
MODES = ("offline", "server")


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def job_medians(base: dict[str, Any]) -> dict[str, float | None]:
    """Each baseline's median call time (ms) in one baseline job."""
    lib = base.get("library_ms") or {}
    times = {"eager": base.get("eager_ms"), "compiled": base.get("compile_ms"),
             **{n: lib.get(n) for n in BASELINES[2:]}}
    return {n: statistics.median(ms) if ms else None for n, ms in times.items()}


def summary(jobs: list[dict[str, float | None]], name: str) -> tuple[float | None, float | None]:
    """(mean of the jobs' medians, spread = (max - min) / mean) of one baseline."""
    xs = [j[name] for j in jobs if j.get(name)]
    if not xs:
        return None, None
    mean = statistics.fmean(xs)
    return mean, (max(xs) - min(xs)) / mean if len(xs) > 1 else None


async def measure_config(ev: Evaluator, c: GemmConfig, jobs: int, server: TimingConfig) -> dict[str, Any]:
    task = gemm_task(c).for_target(ev.target)
    out: dict[str, Any] = {"config": c.__dict__ | {"id": c.id}, "offline": [], "server": [], "errors": []}
    for mode, timing in (("offline", ev.config.timing), ("server", server)):
        for _ in range(jobs):
            base = await ev.ameasure_baselines(task, timing)
            if "error" in base:
                out["errors"].append(f"{mode}: {base['error'][:300]}")
                continue
            out[mode].append(job_medians(base))
            out.setdefault("overhead_ns", []).append(base.get("harness_overhead_ns"))  # the job's calibration
            out.setdefault("breakdown", []).append({k: round(v, 3) for k, v in (base.get("breakdown") or {}).items()})
            out["errors"].extend(f"{mode}: {n}: {why}" for n, why in (base.get("library_errors") or {}).items())
            if base.get("compile_error"):
                out["errors"].append(f"{mode}: torch.compile: {base['compile_error'][:200]}")
    return out


async def evaluate_wmma(ev: Evaluator, c: GemmConfig, root: Path) -> dict[str, Any]:
    task = gemm_task(c).for_target(ev.target)
    ws = Workspace.from_solution(root / c.id, task, WMMA)
    v = await ev.aevaluate(task, ws)
    row: dict[str, Any] = {"id": c.id, "correct": v.correct, "reward": v.reward, "candidate_ms": v.candidate_ms,
                           "baseline_ms": {"eager": v.eager_ms, "compiled": v.compile_ms, **v.library_ms},
                           "reasons": v.reasons[-8:]}
    if v.server is not None:
        s = v.server
        row["server_candidate_ms"] = s.candidate.median_ms
        row["server_baseline_ms"] = {"eager": s.eager.median_ms if s.eager else None,
                                     "compiled": s.compiled.median_ms if s.compiled else None,
                                     **{n: t.median_ms for n, t in s.library.items()}}
    return row


def where_time_went(jobs: list[dict[str, float]]) -> str:
    """A configuration's jobs' mean seconds per phase (waiting for a worker, in it, and its
    phases), largest first: where a configuration's time goes."""
    keys = {k for j in jobs for k in j}
    mean = {k.removeprefix("baseline.").removesuffix("_s"): statistics.fmean(j.get(k, 0.0) for j in jobs) for k in keys}
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(mean.items(), key=lambda kv: -kv[1]))


def us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:#.4g}".rstrip(".")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def config_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="GEMM baselines: median µs (mean of the jobs' medians) and spread over the jobs "
                    "((max - min) / mean), offline | server mode")
    t.add_column("config")
    t.add_column("class")
    for mode in MODES:
        for n in BASELINES:
            t.add_column(f"{TITLES[n]} {mode}", justify="right")
    for r in rows:
        c = r["config"]
        cells = []
        for mode in MODES:
            for n in BASELINES:
                mean, spread = summary(r[mode], n)
                cells.append(f"{us(mean)} ±{pct(spread)}" if mean is not None else "-")
        t.add_row(c['id'].removeprefix('gemm_'), f"{c['shape_class']}{'' if c['aligned'] else '*'}", *cells)
    return t


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def ratio_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="time / torch.matmul's time (same jobs), geomean over configurations; "
                    "max spread over the jobs of any baseline")
    t.add_column("class")
    t.add_column("n", justify="right")
    for mode in MODES:
        for n in BASELINES[1:]:
            t.add_column(f"{TITLES[n]} {mode}", justify="right")
        t.add_column("server / offline (torch.matmul)" if mode == "server" else "max spread offline", justify="right")
    groups = [(cls, [r for r in rows if r["config"]["shape_class"] == cls]) for cls in SHAPE_CLASSES] + [("all", rows)]
    for cls, rs in groups:
        if not rs:
            continue
        cells = []
        for mode in MODES:
            for n in BASELINES[1:]:
                g = geomean([(summary(r[mode], n)[0] or 0) / (summary(r[mode], "eager")[0] or math.inf) for r in rs])
                cells.append("-" if g is None else f"{g:.3f}")
            if mode == "offline":
                cells.append(pct(max((summary(r[mode], n)[1] or 0) for r in rs for n in BASELINES)))
            else:
                g = geomean([(summary(r["server"], "eager")[0] or 0) / (summary(r["offline"], "eager")[0] or math.inf)
                             for r in rs])
                cells.append("-" if g is None else f"{g:.3f}")
        t.add_row(cls, str(len(rs)), *cells)
    return t


def wmma_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="the WMMA solution (examples/gemm/model_new.py): µs and speedup over each baseline "
                    "(baseline time / its time), offline | server mode")
    for col in ("config", "correct", "reward", "WMMA µs", *(TITLES[n] for n in BASELINES),
                "WMMA µs (server)", *(f"{TITLES[n]} (server)" for n in BASELINES)):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        def cells(cand: float | None, base: dict[str, float | None]) -> list[str]:
            return [us(cand)] + ["-" if not cand or not base.get(n) else f"{base[n] / cand:.3f}x" for n in BASELINES]
        t.add_row(r["id"], str(r["correct"]), f"{r['reward']:+g}",
                  *cells(r.get("candidate_ms"), r.get("baseline_ms") or {}),
                  *cells(r.get("server_candidate_ms"), r.get("server_baseline_ms") or {}))
    return t


def save(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)


async def amain(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    report: dict[str, Any] = {"configs": {}, "wmma": {}}
    if args.out and args.out.exists():
        report = json.loads(args.out.read_text())
        progress(f"resuming: {len(report['configs'])} configurations and {len(report['wmma'])} WMMA rows "
                 f"from {args.out}")
    timing = TimingConfig(target_ms=args.target_ms, warmup_ms=args.warmup_ms)
    cfg = EvaluatorConfig(target=args.target, timing=timing, server_gap_ms=TimingConfig.parse_idle(args.server_gaps),
                          **({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    server = cfg.server_timing()
    assert server is not None
    configs = gemm_configs(args.configs, seed=args.seed)
    if args.report_only:
        if not report["configs"] and not report["wmma"]:
            sys.exit(f"--report-only: nothing measured in {args.out}")
        print_report(report, configs)
        return
    with Evaluator(cfg) as ev, tempfile.TemporaryDirectory(prefix="cudagym-gemm-") as tmp:
        report["device"] = ev.device_name
        report["settings"] = {"jobs": args.jobs, "server_gaps_ms": server.idle_ms, "target_ms": args.target_ms,
                              "warmup_ms": args.warmup_ms, "seed": args.seed}
        took: list[float] = []
        for i, c in enumerate(configs):
            if args.only_wmma or c.id in report["configs"]:
                continue
            elapsed = time.perf_counter() - t0
            if took and elapsed + 1.5 * max(took) > args.budget_s:
                left = sum(x.id not in report["configs"] for x in configs)
                progress(f"budget: stopping after {elapsed:.0f} s; {left} "
                         "configurations left (run again with the same --out to go on)")
                break
            s = time.perf_counter()
            report["configs"][c.id] = await measure_config(ev, c, args.jobs, server)
            took.append(time.perf_counter() - s)
            save(args.out, report)
            progress(f"[{i + 1}/{len(configs)}] {c.id} ({c.shape_class}): {took[-1]:.1f} s; per job: "
                     + where_time_went(report["configs"][c.id].get("breakdown") or [])
                     + "".join(f"\n  ! {e}" for e in report["configs"][c.id]["errors"][:2]))
        took_wmma: list[float] = []
        for c in configs[:2 * args.wmma:2]:  # every class, aligned and not, fp16 then bf16
            if c.id in report["wmma"]:
                continue
            # the first row builds the extension (about 100 s on an H100), the others about 30 s
            if time.perf_counter() - t0 + 1.2 * (took_wmma[-1] if took_wmma else 120.0) > args.budget_s:
                progress("budget: WMMA rows left for the next run")
                break
            s = time.perf_counter()
            report["wmma"][c.id] = await evaluate_wmma(ev, c, Path(tmp))
            took_wmma.append(time.perf_counter() - s)
            save(args.out, report)
            progress(f"[wmma] {c.id}: reward {report['wmma'][c.id]['reward']:+g}, {time.perf_counter() - s:.1f} s")
    print_report(report, configs)


def print_report(report: dict[str, Any], configs: list[GemmConfig]) -> None:
    console = Console(width=250)
    rows = [report["configs"][c.id] for c in configs if c.id in report["configs"]]
    console.print(f"device: {report.get('device')}; {len(rows)} of {len(configs)} configurations; "
                  f"settings {report.get('settings')}")
    if rows:
        console.print(config_table(rows))
        console.print(ratio_table(rows))
    wm = [report["wmma"][c.id] for c in configs if c.id in report["wmma"]]
    if wm:
        console.print(wmma_table(wm))
    errors = [(r["config"]["id"], e) for r in rows for e in r["errors"]]
    for cid, e in errors[:20]:
        console.print(f"error: {cid}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, default=50, help="GEMM configurations (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the configurations (default 0)")
    ap.add_argument("--jobs", type=int, default=3, help="separate baseline jobs per mode and configuration (default 3)")
    ap.add_argument("--server-gaps", default="0.5,5", help="server mode's idle gaps, LOW,HIGH ms (default 0.5,5)")
    ap.add_argument(
        "--target-ms", type=float, default=150.0, help="timed calls per role, ms of wall time (default 150)"
    )
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="warm-up per role, ms (default 50)")
    ap.add_argument(
        "--wmma", type=int, default=10, help="configurations the WMMA solution is evaluated on (default 10)"
    )
    ap.add_argument("--only-wmma", action="store_true", help="skip the baseline table (WMMA rows only)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop between configurations past this (default 540)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="the evaluator's cache (default: ~/.cache/cudagym)")
    ap.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of the script (CPU sizes; no cuBLASLt, no WMMA)",
    )
    ap.add_argument("--out", type=Path, default=None, help="every job's medians as JSON; resumed from if it exists")
    ap.add_argument(
        "--report-only", action="store_true", help="print the tables of --out's measurements; measure nothing"
    )
    args = ap.parse_args()
    if args.report_only and not (args.out and args.out.exists()):
        ap.error("--report-only needs --out FILE, an earlier run's measurements")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
