"""Agreement of the profile's candidate time with Nsight Compute's gpu__time_duration (GPU only).

For each task, the honest CUDA solution is profiled once with `ncu=True`: the profile's median
time per call (the protocol of `cudagym.sandbox.timing`) against the sum of the kernels'
gpu__time_duration per call that `ncu` measured (target: within 10%).

Usage: python benchmarks/bench_ncu_agreement.py [TASK_ID ...]   (default: all bundled tasks)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ProfileResult
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, bundled_task_ids

ROOT = Path(__file__).resolve().parent.parent


def ncu_row(p: ProfileResult) -> list[str]:
    """Profile median, ncu's kernel time per call and their ratio (ms)."""
    k = (p.ncu or {}).get("kernel_ms_per_call")
    return [f"{p.candidate.median_ms:.4f}", "-" if not k else f"{k:.4f}",
            "-" if not k else f"{p.candidate.median_ms / k:.3f}"]


def main() -> None:
    ids = sys.argv[1:] or bundled_task_ids()
    console = Console()
    cache = Path(tempfile.mkdtemp(prefix="cudagym-ncu-"))
    table = Table(title="profile vs Nsight Compute (per forward call)")
    for c in ("task", "profile median ms", "ncu kernel ms", "ratio (profile / ncu)"):
        table.add_column(c)
    overhead = None
    with Evaluator(EvaluatorConfig(target="cuda", cache_dir=cache, compile_baseline=False)) as ev:
        for tid in ids:
            task = bundled_task(tid).for_target(ev.target)
            ws = Workspace.from_solution(cache / tid, task, ROOT / "examples" / "solutions" / tid / "cuda")
            assert ev.compile(task, ws).ok
            p = ev.profile(task, ws, ncu=True)
            assert p.ok and p.candidate is not None, p.reasons
            table.add_row(tid, *ncu_row(p))
            overhead = p.harness_overhead_ns or overhead
            if not (p.ncu or {}).get("kernel_ms_per_call"):
                console.print(p.ncu)
    console.print(table)
    if overhead:
        console.print(f"harness overhead left out of each call: {overhead} ns")


if __name__ == "__main__":
    main()
