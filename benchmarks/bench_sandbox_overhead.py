"""Per-check overhead of the sandbox backends: local worker processes against docker containers.

Protocol (CPU target, same run, same cache): one evaluator per backend, two spare workers, the
torch.compile baseline off and the tests' small timing protocol. The solution
(`examples/solutions/<task>/cpu`) is compiled and evaluated once per backend first (build cache,
eager baseline, spares up). Then, `--reps` times per row, with the spares ready before each rep
(start-up is its own row):
- empty job: a probe job that runs `RESULT = 1` (the sandbox's own cost: take a spare, send the
  job, collect, kill; docker adds copying the workspace in and the limits update);
- verify: the candidate's and the reference worker's jobs, comparison included;
- evaluate: compile (cached) + verify + profile (eager baseline cached);
- start-up: a job with no spare ready (`spare_workers=0`): start the worker (docker: create and
  start the container) and import torch, then the empty job.
Each cell is the median wall time in seconds over the reps; the ratio is docker / local.

    python benchmarks/bench_sandbox_overhead.py [--task ew_scale_bias_gelu] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.worker.wire import Job
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task
from cudagym.tasks.model import Target

REPO = Path(__file__).resolve().parent.parent
SMALL_TIMING = TimingConfig(min_calls=10, max_calls=20, target_ms=100, warmup_calls=2)
BACKENDS = ("local", "docker")


def wait_for_spares(ev: Evaluator, want: int, timeout_s: float = 600.0) -> None:
    """Until `want` spares of the CPU are ready (both backends keep them in `_spares`)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pool = ev.sandbox._spares.get("cpu", [])
        if len(pool) >= want and all(w.frames.ready.done() for w in pool):
            return
        time.sleep(0.1)


def median_s(fn: Callable[[], object], reps: int, before: Callable[[], None]) -> float:
    samples = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def probe_job() -> Job:
    return Job(kind="probe", nonce=uuid.uuid4().hex, task_id="bench", probe="RESULT = 1")


def measure(backend: str, task_id: str, reps: int, cache: Path, root: Path) -> dict[str, float]:
    task = bundled_task(task_id).for_target(Target.CPU)
    cfg = EvaluatorConfig(target="cpu", cache_dir=cache, timing=SMALL_TIMING, compile_baseline=False,
                          sandbox={"backend": backend, "spare_workers": 2})
    out: dict[str, float] = {}
    with Evaluator(cfg) as ev:
        ws = Workspace.from_solution(root / f"{backend}-ws", task, REPO / "examples" / "solutions" / task_id / "cpu")
        first = ev.evaluate(task, ws)
        assert first.reward >= 1, (backend, first.reasons, first.error)
        # the evaluate row times a profile on both backends, not a verdict without times
        assert first.eager_ms and first.candidate_ms, (backend, first.reasons)
        ready = lambda: wait_for_spares(ev, 2)  # noqa: E731
        run = ev.sandbox.run_sync  # type: ignore[attr-defined] - both backends have it
        out["empty job"] = median_s(lambda: run(probe_job(), "cpu"), reps, ready)
        out["verify"] = median_s(lambda: ev.verify(task, ws), reps, ready)
        out["evaluate (compile cached)"] = median_s(lambda: ev.evaluate(task, ws), reps, ready)
    cold = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"spare_workers": 0})})
    with Evaluator(cold) as ev:
        run = ev.sandbox.run_sync  # type: ignore[attr-defined]
        out["start-up + empty job (no spare)"] = median_s(lambda: run(probe_job(), "cpu"), reps, lambda: None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="ew_scale_bias_gelu")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cudagym-bench-sandbox-") as tmp:
        results = {b: measure(b, args.task, args.reps, Path(tmp) / "cache", Path(tmp)) for b in BACKENDS}
    table = Table(title=f"per-check wall time, CPU target, {args.task}, median of {args.reps} (s)")
    table.add_column("check")
    for b in BACKENDS:
        table.add_column(f"{b} s", justify="right")
    table.add_column("docker / local", justify="right")
    for row in results["local"]:
        loc, dock = results["local"][row], results["docker"][row]
        table.add_row(row, f"{loc:.3f}", f"{dock:.3f}", f"{dock / loc:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
