"""What the CPU-origin sampler (`cudagym.sandbox.cpusamples`) costs the CPU target's timings.

Protocol (CPU target, same run, same cache): two evaluators, the local sandbox with the sampler
on (`cpu_sample_us` 250, the default: the baseline of each ratio is the other) and off (0), the
torch.compile baseline off. Each task's bundled CPU solution (`examples/solutions/<task>/cpu`) is
evaluated once per evaluator first (build cache, eager baseline, spares up); then `--reps` rounds,
each evaluating it with both, in alternating order. Per task: the median of the candidate's
median call time (ms) and of the whole evaluation's wall time (s) with and without sampling, and
their ratios (on / off); the audit's verdict with sampling on. Run it on a quiet machine.

    python benchmarks/bench_cpu_sampling.py [--tasks ew_scale_bias_gelu,norm_softmax] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="ew_scale_bias_gelu,norm_softmax,red_row_sum")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="cudagym-bench-sampling-") as tmp:
        cache = Path(tmp) / "cache"
        evs = {us: Evaluator(EvaluatorConfig(target="cpu", cache_dir=cache, compile_baseline=False, mode="strict",
                                             sandbox=LocalSandboxConfig(cpu_sample_us=us)))
               for us in (250.0, 0.0)}
        table = Table(title="CPU-origin sampling: on (250 µs) / off, same run")
        for col in ("task", "candidate ms on", "off", "ratio", "evaluation s on", "off", "ratio", "audit (on)"):
            table.add_column(col)
        try:
            for task_id in args.tasks.split(","):
                task = bundled_task(task_id)
                ws = Workspace.from_solution(Path(tmp) / f"ws-{task_id}", task,
                                             REPO / "examples" / "solutions" / task_id / "cpu")
                for ev in evs.values():
                    ev.evaluate(task, ws)
                ms: dict[float, list[float]] = {us: [] for us in evs}
                wall: dict[float, list[float]] = {us: [] for us in evs}
                audit = ""
                for rep in range(args.reps):
                    for us in (list(evs) if rep % 2 == 0 else list(evs)[::-1]):
                        t0 = time.perf_counter()
                        v = evs[us].evaluate(task, ws)
                        wall[us].append(time.perf_counter() - t0)
                        if v.candidate_ms is not None:
                            ms[us].append(v.candidate_ms)
                        if us and v.audit is not None:
                            audit = "passed" if v.audit.passed else "; ".join(v.audit.reasons)[:60]
                m = {us: statistics.median(x) if x else float("nan") for us, x in ms.items()}
                w = {us: statistics.median(x) for us, x in wall.items()}
                table.add_row(task_id, f"{m[250.0]:.3f}", f"{m[0.0]:.3f}", f"{m[250.0] / m[0.0]:.3f}",
                              f"{w[250.0]:.2f}", f"{w[0.0]:.2f}", f"{w[250.0] / w[0.0]:.3f}", audit)
                console.print(f"{task_id}: done", style="dim")
        finally:
            for ev in evs.values():
                ev.close()
        console.print(table)


if __name__ == "__main__":
    main()
