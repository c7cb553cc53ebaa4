"""Evaluation speed and timing quality, on one kernel, with baselines measured in the same run.

Prints:
1. verify + profile overhead beyond the kernel's own run time, with baselines cached and spare
   workers warm, against the cost of one fresh worker (`python -c "import torch; <CUDA context>"`),
   which is what a harness that starts a process per check pays; then where the time goes (the
   evaluator's and the worker's phases);
2. a whole step: edit the .cu → compile → verify → profile;
3. timing spread: per-job median, p10 and min over 10 separate profile jobs (fresh workers) of
   each `--spread-tasks` kernel, and their CV across jobs;
4. agreement of the profile's candidate time with Nsight Compute's gpu__time_duration (GPU).

The spread tables also show each job's harness overhead (left out of every call; measured by
each fresh worker). Diagnostics: `--no-flush-variant` repeats the spread without the L2 flush,
`--profile-compare` cProfiles one verify's output comparison.

Usage: python benchmarks/bench_eval.py [--target auto|cuda|cpu] [--task ID] [--spread-tasks A,B]
           [--ncu-task ID] [--repeats N] [--think-s S] [--spread-jobs N]
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
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

from bench_ncu_agreement import ncu_row  # this folder's script

ROOT = Path(__file__).resolve().parent.parent


def fresh_worker_s(cuda: bool) -> float:
    code = "import torch; torch.empty(1, device='cuda')" if cuda else "import torch; torch.empty(1)"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def spread(ev: Evaluator, console: Console, cache: Path, task_id: str, sol: str, jobs: int, pause_s: float,
           label: str) -> None:
    """`jobs` separate profile jobs of one kernel: per-job statistics and their CV across jobs."""
    task = bundled_task(task_id).for_target(ev.target)
    ws = Workspace.from_solution(cache / f"spread_{task_id}{len(label)}", task,
                                 ROOT / "examples" / "solutions" / task_id / sol)
    assert ev.compile(task, ws).ok
    ev.profile(task, ws)  # baselines
    t = Table(title=f"{task.id}: {jobs} separate profile jobs (fresh workers){label}")
    for c in ("job", "median ms", "p10 ms", "min ms", "IQR ms", "calls", "harness overhead ns", "SM MHz before/after"):
        t.add_column(c)
    stats: dict[str, list[float]] = {"median": [], "p10": [], "min": []}
    for j in range(jobs):
        time.sleep(pause_s)
        p = ev.profile(task, ws)
        assert p.ok, p
        c = p.candidate
        for k, x in (("median", c.median_ms), ("p10", c.p10_ms), ("min", c.min_ms)):
            stats[k].append(x)
        tb, ta = p.telemetry.get("before", {}), p.telemetry.get("after", {})
        t.add_row(str(j), f"{c.median_ms:.4f}", f"{c.p10_ms:.4f}", f"{c.min_ms:.4f}", f"{c.iqr_ms:.4f}", str(c.n),
                  str(p.harness_overhead_ns), f"{tb.get('sm_clock_mhz', '-')}/{ta.get('sm_clock_mhz', '-')}")
    console.print(t)
    t = Table(title=f"timing spread over {jobs} separate profile jobs of {task.id}{label}")
    for c in ("per-job statistic", "median over jobs ms", "min ms", "max ms", "CV across jobs (target < 1%)"):
        t.add_column(c)
    for k, xs in stats.items():
        name = "median (the reported time)" if k == "median" else k
        t.add_row(name, f"{statistics.median(xs):.4f}", f"{min(xs):.4f}", f"{max(xs):.4f}",
                  f"{statistics.pstdev(xs) / statistics.fmean(xs):.2%}")
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="auto")
    ap.add_argument("--task", default="ew_scale_bias_gelu")
    ap.add_argument("--ncu-task", default="mm_linear_gelu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--spread-jobs", type=int, default=10)
    ap.add_argument("--no-compile-baseline", action="store_true", help="skip torch.compile (quick smoke runs)")
    ap.add_argument("--profile-compare", action="store_true", help="cProfile one verify's output comparison")
    ap.add_argument("--no-flush-variant", action="store_true", help="also measure the spread without the L2 flush")
    ap.add_argument("--spread-tasks", default="ew_scale_bias_gelu,mm_linear_gelu",
                    help="comma-separated bundled task ids whose timing spread is measured")
    ap.add_argument("--think-s", type=float, default=4.0, help="pause between steps (an agent's turn)")
    args = ap.parse_args()
    console = Console()
    cache = Path(tempfile.mkdtemp(prefix="cudagym-bench-"))
    config = EvaluatorConfig(target=args.target, cache_dir=cache, compile_baseline=not args.no_compile_baseline)
    with Evaluator(config) as ev:
        cuda = ev.device == "cuda"
        sol = "cuda" if cuda else "cpu"
        task = bundled_task(args.task).for_target(ev.target)
        ws = Workspace.from_solution(cache / "ws", task, ROOT / "examples" / "solutions" / args.task / sol)
        console.print(f"device: {ev.device_name}; task {task.id}")
        assert ev.compile(task, ws).ok
        first = ev.evaluate(task, ws)  # pays for baselines (incl. the first torch.compile) once
        console.print(f"first evaluation (baselines measured): reward {first.reward}, {first.reasons}")
        fresh = statistics.median(fresh_worker_s(cuda) for _ in range(3))

        verify_s, profile_s, v_over, p_over, loop_s = [], [], [], [], []
        v_parts: dict[str, list[float]] = {}
        p_parts: dict[str, list[float]] = {}
        trials = ev.config.verify.trials
        for _ in range(args.repeats):
            time.sleep(args.think_s)  # the policy's turn: spare workers finish starting meanwhile
            v = ev.verify(task, ws)
            p = ev.profile(task, ws)
            assert v.ok and p.ok, (v, p)
            cand, eager = p.candidate.median_ms / 1e3, p.eager.median_ms / 1e3
            loop = p.breakdown.get("candidate.candidate_timed_loop_s", 0.0)  # warm-up + timed calls
            v_wall = v.seconds  # includes the comparison
            verify_s.append(v_wall)
            profile_s.append(p.seconds)
            v_over.append(v_wall - trials * (cand + eager))
            p_over.append(p.seconds - loop)
            loop_s.append(loop)
            for parts, r in ((v_parts, v), (p_parts, p)):
                for k, x in r.breakdown.items():
                    parts.setdefault(k, []).append(x)
        med = statistics.median
        if args.profile_compare:  # where the evaluator's comparison spends its time (one verify)
            import cProfile
            import pstats

            import cudagym.rewards.evaluator as evaluator_module

            original = evaluator_module.compare_outputs

            def profiled(tensors, tol):  # noqa: ANN001, ANN202
                prof = cProfile.Profile()
                out = prof.runcall(original, tensors, tol)
                pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                return out

            evaluator_module.compare_outputs = profiled
            time.sleep(args.think_s)
            ev.verify(task, ws)
            evaluator_module.compare_outputs = original
        t = Table(title="verify + profile: wall time and overhead beyond the kernel's own run time (baselines cached)")
        for c in ("step", "median s", "vs one fresh worker"):
            t.add_column(c)
        t.add_row("fresh worker (baseline: python + import torch + context)", f"{fresh:.3f}", "1.00x")
        t.add_row("verify (wall)", f"{med(verify_s):.3f}", f"{med(verify_s) / fresh:.2f}x")
        t.add_row("  overhead beyond the kernel's calls", f"{med(v_over):.3f}", f"{med(v_over) / fresh:.2f}x")
        t.add_row("profile (wall)", f"{med(profile_s):.3f}", f"{med(profile_s) / fresh:.2f}x")
        t.add_row("  timed loop (warm-up + timed calls)", f"{med(loop_s):.3f}", f"{med(loop_s) / fresh:.2f}x")
        t.add_row("  overhead beyond the timed loop", f"{med(p_over):.3f}", f"{med(p_over) / fresh:.2f}x")
        t.add_row("verify+profile overhead", f"{med(v_over) + med(p_over):.3f}",
                  f"{(med(v_over) + med(p_over)) / fresh:.2f}x")
        console.print(t)
        for name, parts in (("verify", v_parts), ("profile", p_parts)):
            t = Table(title=f"where {name}'s time goes (median s over {args.repeats})")
            t.add_column("part")
            t.add_column("median s")
            for k, xs in parts.items():
                t.add_row(k, f"{med(xs):.4f}")
            console.print(t)

        # a whole step after an edit of the .cu (a real change, so the cache cannot answer)
        src = sorted((ws.root / "kernels").glob("*.c*"))[0]
        steps = []
        for i in range(3):
            text = src.read_text()
            src.write_text(text + f"\n// edit {i} {time.time()}\n"
                           f"static int cudagym_bench_edit_{i}_{int(time.time())} = {i};\n")
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

        for spread_id in args.spread_tasks.split(","):
            spread(ev, console, cache, spread_id, sol, args.spread_jobs, args.think_s / 2, "")

        if cuda:
            ntask = bundled_task(args.ncu_task).for_target(ev.target)
            nws = Workspace.from_solution(cache / "ncu_ws", ntask,
                                          ROOT / "examples" / "solutions" / args.ncu_task / "cuda")
            p = ev.profile(ntask, nws, ncu=True)
            t = Table(title=f"profile vs Nsight Compute on {ntask.id}")
            for c in ("profile median ms", "ncu kernel ms per call", "ratio (profile / ncu)"):
                t.add_column(c)
            t.add_row(*ncu_row(p))
            console.print(t)
            if (p.ncu or {}).get("kernel_ms_per_call") is None:
                console.print(p.ncu)
    if args.no_flush_variant:  # diagnostic: the same spread without the L2 flush
        cfg = EvaluatorConfig(target=args.target, cache_dir=cache, compile_baseline=False,
                              timing=TimingConfig(flush_l2=False))
        with Evaluator(cfg) as ev:
            spread(ev, console, cache, args.spread_tasks.split(",")[0], sol, args.spread_jobs, args.think_s / 2,
                   " (diagnostic: no L2 flush)")


if __name__ == "__main__":
    main()
