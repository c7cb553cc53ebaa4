"""Evaluation speed and timing quality, on one kernel, with baselines measured in the same run.

Prints:
1. verify + profile overhead beyond the kernel's own run time, with baselines cached and spare
   workers warm, against the cost of one fresh worker (`python -c "import torch; <CUDA context>"`),
   which is what a harness that starts a process per check pays;
2. a whole step: edit the .cu → compile → verify → profile;
3. timing spread: the candidate's median over 10 separate profile jobs (fresh workers): CV;
4. agreement of the profile's candidate time with Nsight Compute's gpu__time_duration (GPU).

Usage: python benchmarks/bench_eval.py [--target auto|cuda|cpu] [--task ID] [--ncu-task ID]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

ROOT = Path(__file__).resolve().parent.parent


def fresh_worker_s(cuda: bool) -> float:
    code = "import torch; torch.empty(1, device='cuda')" if cuda else "import torch; torch.empty(1)"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="auto")
    ap.add_argument("--task", default="ew_scale_bias_gelu")
    ap.add_argument("--ncu-task", default="mm_linear_gelu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--spread-jobs", type=int, default=10)
    ap.add_argument("--think-s", type=float, default=4.0, help="pause between steps (an agent's turn)")
    args = ap.parse_args()
    console = Console()
    cache = Path(tempfile.mkdtemp(prefix="cudagym-bench-"))
    with Evaluator(EvaluatorConfig(target=args.target, cache_dir=cache)) as ev:
        cuda = ev.device == "cuda"
        sol = "cuda" if cuda else "cpu"
        task = bundled_task(args.task).for_target(ev.target)
        ws = Workspace.from_solution(cache / "ws", task, ROOT / "examples" / "solutions" / args.task / sol)
        console.print(f"device: {ev.device_name}; task {task.id}")
        assert ev.compile(task, ws).ok
        first = ev.evaluate(task, ws)  # pays for baselines (incl. the first torch.compile) once
        console.print(f"first evaluation (baselines measured): reward {first.reward}, {first.reasons}")
        fresh = statistics.median(fresh_worker_s(cuda) for _ in range(3))

        verify_s, profile_s, overhead_s = [], [], []
        cfg = ev.config
        for _ in range(args.repeats):
            time.sleep(args.think_s)  # the policy's turn: spare workers finish starting meanwhile
            t0 = time.perf_counter()
            v = ev.verify(task, ws)
            t1 = time.perf_counter()
            p = ev.profile(task, ws)
            t2 = time.perf_counter()
            assert v.ok and p.ok, (v, p)
            cand, eager = p.candidate.median_ms / 1e3, p.eager.median_ms / 1e3
            kernel = (cfg.verify.trials * (cand + eager) + (p.candidate.n + cfg.timing.warmup_calls) * cand
                      + cfg.timing.recheck_calls * eager)
            verify_s.append(t1 - t0)
            profile_s.append(t2 - t1)
            overhead_s.append((t2 - t0) - kernel)
        t = Table(title="verify + profile overhead beyond the kernel's own time (baselines cached)")
        for c in ("step", "median s", "vs one fresh worker"):
            t.add_column(c)
        t.add_row("fresh worker (baseline: python + import torch + context)", f"{fresh:.3f}", "1.00x")
        t.add_row("verify (wall)", f"{statistics.median(verify_s):.3f}", f"{statistics.median(verify_s) / fresh:.2f}x")
        t.add_row("profile (wall)", f"{statistics.median(profile_s):.3f}", f"{statistics.median(profile_s) / fresh:.2f}x")
        t.add_row("verify+profile overhead", f"{statistics.median(overhead_s):.3f}",
                  f"{statistics.median(overhead_s) / fresh:.2f}x")
        console.print(t)

        # a whole step after an edit of the .cu (a real change, so the cache cannot answer)
        src = sorted((ws.root / "kernels").glob("*.c*"))[0]
        steps = []
        for i in range(3):
            text = src.read_text()
            src.write_text(text + f"\n// edit {i} {time.time()}\nstatic int cudagym_bench_edit_{i}_{int(time.time())} = {i};\n")
            time.sleep(args.think_s)
            t0 = time.perf_counter()
            c = ev.compile(task, ws)
            t1 = time.perf_counter()
            v = ev.verify(task, ws)
            p = ev.profile(task, ws)
            t2 = time.perf_counter()
            assert c.ok and not c.cached and v.ok and p.ok
            steps.append((t1 - t0, t2 - t1, t2 - t0))
        t = Table(title="one agent step after editing the .cu")
        for c in ("compile s", "verify+profile s", "whole step s"):
            t.add_column(c)
        for s in steps:
            t.add_row(*(f"{x:.2f}" for x in s))
        console.print(t)

        medians = []
        for _ in range(args.spread_jobs):
            time.sleep(args.think_s / 2)
            p = ev.profile(task, ws)
            medians.append(p.candidate.median_ms)
        cv = statistics.pstdev(medians) / statistics.fmean(medians)
        t = Table(title=f"timing spread over {args.spread_jobs} separate profile jobs (fresh workers)")
        for c in ("median of medians ms", "min ms", "max ms", "CV"):
            t.add_column(c)
        t.add_row(f"{statistics.median(medians):.4f}", f"{min(medians):.4f}", f"{max(medians):.4f}", f"{cv:.2%}")
        console.print(t)

        if cuda:
            ntask = bundled_task(args.ncu_task).for_target(ev.target)
            nws = Workspace.from_solution(cache / "ncu_ws", ntask, ROOT / "examples" / "solutions" / args.ncu_task / "cuda")
            p = ev.profile(ntask, nws, ncu=True)
            t = Table(title=f"profile vs Nsight Compute on {ntask.id}")
            for c in ("profile median ms", "ncu kernel ms per call", "ratio"):
                t.add_column(c)
            k = (p.ncu or {}).get("kernel_ms_per_call")
            t.add_row(f"{p.candidate.median_ms:.4f}", "-" if k is None else f"{k:.4f}",
                      "-" if not k else f"{p.candidate.median_ms / k:.3f}")
            console.print(t)
            if k is None:
                console.print(p.ncu)


if __name__ == "__main__":
    main()
