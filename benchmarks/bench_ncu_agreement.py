"""Agreement of the profile's candidate time with Nsight Compute's gpu__time_duration (GPU only).

For each task, the honest CUDA solution is profiled once with `ncu=True`: the profile's median
time per call (the traced protocol of `cudagym.sandbox.timing`) against the sum of the kernels'
gpu__time_duration per call that `ncu` measured (target: within 10%). The GPU busy time of the
same trace (the summed duration of the call's kernels) is shown too.

Usage: python benchmarks/bench_ncu_agreement.py [TASK_ID ...]   (default: all bundled tasks)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.rewards.verdict import ProfileResult
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, bundled_task_ids

ROOT = Path(__file__).resolve().parent.parent


def ncu_row(p: ProfileResult) -> list[str]:
    """Profile median, GPU busy median, ncu's kernel time per call and their ratio (ms)."""
    k = (p.ncu or {}).get("kernel_ms_per_call")
    busy = f"{p.candidate_kernel.median_ms:.4f}" if p.candidate_kernel else "-"
    return [f"{p.candidate.median_ms:.4f}", busy, "-" if not k else f"{k:.4f}",
            "-" if not k else f"{p.candidate.median_ms / k:.3f}"]


def main() -> None:
    ids = sys.argv[1:] or bundled_task_ids()
    console = Console()
    cache = Path(tempfile.mkdtemp(prefix="cudagym-ncu-"))
    table = Table(title="profile vs Nsight Compute (per forward call)")
    for c in ("task", "profile median ms", "GPU busy median ms", "ncu kernel ms", "ratio (profile / ncu)"):
        table.add_column(c)
    latency = None
    with Evaluator(EvaluatorConfig(target="cuda", cache_dir=cache, compile_baseline=False)) as ev:
        for tid in ids:
            task = bundled_task(tid).for_target(ev.target)
            ws = Workspace.from_solution(cache / tid, task, ROOT / "examples" / "solutions" / tid / "cuda")
            assert ev.compile(task, ws).ok
            p = ev.profile(task, ws, ncu=True)
            assert p.ok and p.candidate is not None, p.reasons
            table.add_row(tid, *ncu_row(p))
            latency = p.harness_latency_ns or latency
            if not (p.ncu or {}).get("kernel_ms_per_call"):
                console.print(p.ncu)
    console.print(table)
    if latency:
        console.print(f"harness latencies left out of each call (start, end): {latency[0]} ns, {latency[1]} ns")


if __name__ == "__main__":
    main()
