"""Timing fidelity: cudagym's eager baseline and candidate times against Nsight Compute, Triton's
`do_bench` and KernelBench-style events, over the problems of `timing_problems.py` (3 µs to 9 ms
of GPU time per call on an H100). About 3 minutes on an H100 (16 cores), over 4 on an H200.

Per problem, in one run (phases in this order, never overlapping on the GPU):
1. cudagym (one `Evaluator`, fresh cache directory, permissive mode, no torch.compile baseline):
   the eager median (median of the per-call times `abaselines` returns) and the candidate median
   (`aprofile` of a workspace whose model_new.py is the reference with `Model` renamed
   `ModelNew`: the same torch ops, so it should read like eager);
2. spread (`--spread`, on by default; same evaluator, spares running as in real use): the
   candidate medians of 10 separate profile jobs (each a fresh worker) of one single-kernel
   problem of >= 50 µs and one of 5-10 µs; their CV against the targets (< 1%, < 3%);
3. `timing_driver.py direct` in its own process: `do_bench(fn, return_mode="median")` (L2
   flushed by do_bench) and KernelBench-style events (3 warm-up calls, then events around each
   call + `torch.cuda.synchronize()`, L2 not flushed, median of 100 calls); on the CPU target
   the wall clock instead;
4. Nsight Compute, run once over `timing_driver.py ncu` (`--clock-control none`, caches flushed
   before each kernel, `--profile-from-start off`): the sum of `gpu__time_duration.sum` of a
   call's kernels, median over the calls; kernels are attributed to calls by the marker kernel
   the driver launches after each call (the marker count and the order are checked).

Printed (stdout): one table, ms with 4 significant digits, ratios to ncu, and per row the
acceptance: a single-kernel problem (one kernel per call in ncu) passes if the eager and
candidate medians are both within 10% of ncu or 2 µs, whichever is larger; a row of k kernels
per call passes within 10% + 2 µs x k of ncu's sum (ncu's per-kernel figure holds each kernel's
own ~1 µs launch on the GPU; cudagym's time holds the gaps between dependent kernels). Then the
spread table. Progress goes to stderr.

Usage: python benchmarks/bench_baselines.py [--problems a,b,c] [--out FILE.json] [--no-ncu]
           [--quick] [--no-spread] [--target auto|cuda|cpu]
On the CPU target (no GPU), run with --no-ncu: cudagym's columns and a wall-clock column.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig, resolve_target
from cudagym.sandbox.gpu import gpu_count
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target
from timing_driver import MARKER_KERNEL  # this folder's modules
from timing_problems import TimingProblem, candidate_source, problems_by_name, time_class

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "timing_driver.py"
# (problem, CV target of its candidate medians over separate profile jobs)
SPREAD = (("layernorm_4096x4096", 0.01), ("softmax_16x16384", 0.03))  # 62 µs and 8.6 µs, one kernel each
ACCEPT_REL, ACCEPT_ABS_MS = 0.10, 0.002  # single-kernel rows: within 10% of ncu or 2 µs
NCU_METRIC = "gpu__time_duration.sum"
# ncu 2025.3 writes "ns"; older versions wrote "nsecond"
NCU_UNIT_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
               "s": 1e3, "second": 1e3}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sig4(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:#.4g}".rstrip(".")


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


# -- 1 and 2: cudagym ----------------------------------------------------------------------------
async def cudagym_times(ev: Evaluator, problem: TimingProblem, root: Path) -> dict[str, Any]:
    """The eager baseline's per-call times and the same-ops candidate's profile, in ms."""
    task = problem.task().for_target(ev.target)
    out: dict[str, Any] = {}
    base = await ev.abaselines(task)
    if "error" in base:
        out["eager_error"] = base["error"]
    else:
        out["eager_ms"] = base["eager_ms"]
        out["eager_median_ms"] = statistics.median(base["eager_ms"])
        out["eager_clock_gap_ms"] = base.get("eager_clock_gap_ms")
        out["eager_late_launches"] = base.get("eager_late_launches")  # (count, median host span ms)
    ws = Workspace.create(root / problem.name, task, model_new=candidate_source(task.code))
    p = await ev.aprofile(task, ws)
    if p.ok and p.candidate is not None:
        out["candidate"] = p.candidate.model_dump()
        out["candidate_median_ms"] = p.candidate.median_ms
        out["candidate_reasons"] = p.reasons
        out["harness_overhead_ns"] = p.harness_overhead_ns
        out["candidate_clock_gap_ms"] = p.clock_gap_ms
        out["candidate_late_launches"] = (p.late_launches, p.host_ms)
    else:
        out["candidate_error"] = p.error
    return out


async def spread_medians(ev: Evaluator, problem: TimingProblem, jobs: int, root: Path) -> dict[str, Any]:
    """Candidate medians of `jobs` separate profile jobs (each in a fresh worker)."""
    task = problem.task().for_target(ev.target)
    ws = Workspace.create(root / f"spread_{problem.name}", task, model_new=candidate_source(task.code))
    medians: list[float] = []
    gaps: list[float | None] = []
    late: list[tuple[int, float | None]] = []
    overheads: list[int | None] = []  # each job's own calibration, left out of its calls
    clocks: list[tuple[Any, Any]] = []  # each job's SM clock (MHz, NVML) before and after its timed loop
    for _ in range(jobs):
        p = await ev.aprofile(task, ws)
        if not (p.ok and p.candidate is not None):
            return {"medians_ms": medians, "clock_gaps_ms": gaps, "late_launches": late, "error": p.error}
        medians.append(p.candidate.median_ms)
        gaps.append(p.clock_gap_ms)
        late.append((p.late_launches, p.host_ms))
        overheads.append(p.harness_overhead_ns)
        clocks.append(tuple((p.telemetry.get(when) or {}).get("sm_clock_mhz") for when in ("before", "after")))
    raw = [m + (o or 0) / 1e6 for m, o in zip(medians, overheads)]
    return {"medians_ms": medians, "clock_gaps_ms": gaps, "late_launches": late, "overheads_ns": overheads,
            "sm_clocks_mhz": clocks,
            "cv": statistics.pstdev(medians) / statistics.fmean(medians),
            "cv_with_overhead": statistics.pstdev(raw) / statistics.fmean(raw)}


async def cudagym_phase(args: argparse.Namespace, problems: list[TimingProblem], cache: Path,
                        results: dict[str, dict[str, Any]], spread: dict[str, dict[str, Any]],
                        save: Callable[[], None] = lambda: None) -> str:
    """Phases 1 and 2; returns the device's name. `save()` after each problem and spread (a run
    cut short keeps what it measured)."""
    cfg = EvaluatorConfig(target=args.target, mode="permissive", cache_dir=cache, compile_baseline=False)
    with Evaluator(cfg) as ev:
        for problem in problems:
            t0 = time.perf_counter()
            r = await cudagym_times(ev, problem, cache / "ws")
            results[problem.name].update(r)
            progress(f"[cudagym] {problem.name}: eager {sig4(r.get('eager_median_ms'))} ms, candidate "
                     f"{sig4(r.get('candidate_median_ms'))} ms ({time.perf_counter() - t0:.1f} s)"
                     + "".join(f"; {k}: {str(r[k])[:300]}" for k in ("eager_error", "candidate_error") if k in r))
            save()
        if args.spread:
            jobs = 3 if args.quick else 10
            for name, target_cv in SPREAD:
                t0 = time.perf_counter()
                s = await spread_medians(ev, problems_by_name([name])[0], jobs, cache / "ws")
                spread[name] = {**s, "target_cv": target_cv}
                outcome = f"CV {s['cv']:.2%}" if "cv" in s else f"error: {s['error']}"
                progress(f"[spread] {name}: {len(s['medians_ms'])} jobs, {outcome} ({time.perf_counter() - t0:.1f} s)")
                save()
        return ev.device_name


# -- 3 and 4: outside cudagym ------------------------------------------------------------------------
def run_driver(cmd: list[str], out: Path, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Run a driver command that writes `out`; its results by problem name."""
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, stdout=subprocess.PIPE, stderr=None, text=True)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd[:3])}... timed out after {timeout_s:.0f} s") from None
    if not out.exists():
        raise RuntimeError(f"the driver wrote no results (exit {proc.returncode}); its output:\n{proc.stdout[-3000:]}")
    return {r["problem"]: r for r in json.loads(out.read_text())["results"]}


def driver_cmd(mode: str, target: str, problems: list[TimingProblem], calls: int, out: Path) -> list[str]:
    return [sys.executable, str(DRIVER), mode, "--target", target, "--problems", ",".join(p.name for p in problems),
            "--calls", str(calls), "--out", str(out)]


def ncu_launches(text: str) -> list[tuple[str, float]]:
    """(kernel name, gpu__time_duration in ms) of every profiled kernel launch, in launch order,
    from ncu's `--csv` log."""
    start = text.find('"ID"')
    if start < 0:
        raise RuntimeError("ncu's log holds no metrics table:\n" + text[-3000:])
    launches: list[tuple[int, str, float]] = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != NCU_METRIC:
            continue
        unit = row["Metric Unit"]
        if unit not in NCU_UNIT_MS:
            raise RuntimeError(f"ncu's log gives {NCU_METRIC} in an unknown unit {unit!r}")
        value = float(row["Metric Value"].replace(",", ""))
        launches.append((int(row["ID"]), row["Kernel Name"], value * NCU_UNIT_MS[unit]))
    launches.sort()
    return [(name, ms) for _, name, ms in launches]


def attribute_calls(launches: list[tuple[str, float]], manifest: dict[str, dict[str, Any]]
                    ) -> dict[str, list[list[tuple[str, float]]]]:
    """Each problem's calls, each call the (name, ms) of its kernels: the kernels up to a marker
    are one call's, and the driver's manifest says how many calls each problem made, in order."""
    calls: list[list[tuple[str, float]]] = [[]]
    for name, ms in launches:
        if MARKER_KERNEL in name:
            calls.append([])
        else:
            calls[-1].append((name, ms))
    trailing = calls.pop()
    expected = sum(m.get("calls", 0) for m in manifest.values())
    if trailing or len(calls) != expected:
        raise RuntimeError(f"ncu's log has {len(calls)} marker kernels and {len(trailing)} kernels after the last; "
                           f"the driver made {expected} calls: kernels cannot be attributed to problems")
    out, i = {}, 0
    for name, m in manifest.items():  # the manifest lists problems in the order they ran
        out[name] = calls[i:i + m.get("calls", 0)]
        i += m.get("calls", 0)
    return out


def ncu_summary(calls: list[list[tuple[str, float]]]) -> dict[str, Any]:
    per_call = [sum(ms for _, ms in c) for c in calls]
    counts = sorted({len(c) for c in calls})
    return {"ncu_ms": statistics.median(per_call), "ncu_per_call_ms": per_call, "kernels_per_call": counts,
            "ncu_kernels": [[[name[:160], ms] for name, ms in c] for c in calls]}


def ncu_phase(problems: list[TimingProblem], calls: int, work: Path,
              cache_control: str = "all") -> tuple[str, dict[str, dict[str, Any]]]:
    """ncu's version, and its kernel time per call of each problem (one ncu run over all of them).
    `cache_control` "all" (the acceptance's) flushes and invalidates every cache before each
    kernel, the instruction and constant caches too, and a buffer the call wrote just before
    the kernel (a reduction's zeroed semaphores); "none" leaves them as the call left them."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on PATH: the ncu columns and the acceptance are skipped "
                           "(pass --no-ncu to skip it on purpose)")
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    log, manifest_path = work / "ncu.csv", work / "ncu_manifest.json"
    cmd = [ncu, "--csv", "--clock-control", "none", "--cache-control", cache_control, "--profile-from-start", "off",
           "--metrics", NCU_METRIC, "--log-file", str(log),
           *driver_cmd("ncu", "cuda", problems, calls, manifest_path)]
    manifest = run_driver(cmd, manifest_path, timeout_s=360)
    if not log.exists():
        raise RuntimeError("ncu wrote no log")
    by_problem = attribute_calls(ncu_launches(log.read_text(errors="replace")), manifest)
    out = {}
    for name, m in manifest.items():
        if "error" in m:
            out[name] = {"ncu_error": m["error"]}
        elif by_problem[name]:
            out[name] = ncu_summary(by_problem[name])
    return version.splitlines()[-1] if version else "?", out


def direct_phase(target: Target, problems: list[TimingProblem], calls: int, work: Path,
                 results: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """do_bench and KernelBench-style events (GPU) or the wall clock (CPU), into `results`."""
    cuda = target == Target.CUDA
    progress(f"[direct] {'do_bench and KernelBench-style events' if cuda else 'wall clock'}, {calls} calls each")
    out = work / "direct.json"
    try:
        direct = run_driver(driver_cmd("direct", target.value, problems, calls, out), out, timeout_s=300)
    except RuntimeError as e:
        notes.append(f"direct timing failed: {e}")
        return
    for name, d in direct.items():
        results[name].update(d)
        for key in ("events_ms", "wall_ms"):
            if key in d:
                results[name][key.replace("_ms", "_median_ms")] = statistics.median(d[key])
        if "do_bench_error" in d and d["do_bench_error"] not in notes:
            notes.append(d["do_bench_error"])


# -- tables --------------------------------------------------------------------------------------------
def acceptance(r: dict[str, Any]) -> tuple[bool | None, str]:
    """(passed or None where the rule does not apply, text) of one problem's row."""
    errors = [f"{k.split('_')[0]} error: {str(r[k]).strip().splitlines()[0][:100]}"
              for k in ("eager_error", "candidate_error", "ncu_error") if r.get(k)]
    if errors:
        return None, "; ".join(errors)
    ncu, eager, cand = r.get("ncu_ms"), r.get("eager_median_ms"), r.get("candidate_median_ms")
    if ncu is None or eager is None or cand is None:
        return None, "-"
    diff = f"eager {(eager - ncu) * 1e3:+.1f} µs, cand {(cand - ncu) * 1e3:+.1f} µs"
    kernels = max(r["kernels_per_call"])
    # one kernel: 10% or 2 µs. k kernels: ncu's sum counts each kernel's own ~1 µs launch on the
    # GPU, and the gaps between dependent kernels are timed, so 2 µs per kernel plus 10%
    tol = max(ACCEPT_REL * ncu, ACCEPT_ABS_MS) if kernels == 1 else ACCEPT_REL * ncu + ACCEPT_ABS_MS * kernels
    bad = [who for who, t in (("eager", eager), ("cand", cand)) if abs(t - ncu) > tol]
    rule = "" if kernels == 1 else f" ({kernels} kernels, ±{tol * 1e3:.1f} µs)"
    return not bad, ("PASS" if not bad else "FAIL " + "+".join(bad)) + f"{rule}: {diff}"


def main_table(problems: list[TimingProblem], results: dict[str, dict[str, Any]], cuda: bool) -> Table:
    t = Table(title="per forward call: cudagym vs Nsight Compute, do_bench and KernelBench-style events (ms)"
              if cuda else "per forward call: cudagym vs the wall clock (CPU target, ms)")
    cols = ["problem", "class"]
    cols += (["kernels", "ncu", "eager", "cand", "do_bench", "KB events", "eager/ncu", "cand/ncu", "do_bench/ncu",
              "KB/ncu", "acceptance (1 kernel: within max(10%, 2 µs) of ncu; k: 10% + 2 µs × k)"] if cuda
             else ["eager", "cand", "wall", "eager/wall", "cand/wall"])
    for c in cols:
        t.add_column(c, overflow="fold")
    for p in problems:
        r = results[p.name]
        cls = p.time_class
        if r.get("ncu_ms") is not None and time_class(r["ncu_ms"] * 1e3) != cls:
            cls += f"→{time_class(r['ncu_ms'] * 1e3)}"
        eager, cand = r.get("eager_median_ms"), r.get("candidate_median_ms")
        if cuda:
            ncu, events = r.get("ncu_ms"), r.get("events_median_ms")
            kernels = "-".join(str(k) for k in r["kernels_per_call"]) if "kernels_per_call" in r else "-"
            t.add_row(p.name, cls, kernels, sig4(ncu), sig4(eager), sig4(cand), sig4(r.get("do_bench_ms")),
                      sig4(events), ratio(eager, ncu), ratio(cand, ncu), ratio(r.get("do_bench_ms"), ncu),
                      ratio(events, ncu), acceptance(r)[1])
        else:
            wall = r.get("wall_median_ms")
            t.add_row(p.name, cls, sig4(eager), sig4(cand), sig4(wall), ratio(eager, wall), ratio(cand, wall))
    return t


def spread_table(spread: dict[str, dict[str, Any]], cuda: bool) -> Table:
    t = Table(title="spread of the candidate median over separate profile jobs (fresh workers)")
    for c in ("problem", "jobs", "median of medians ms", "min ms", "max ms", "CV", "target", "acceptance",
              "CV with overhead left in", "overhead µs, min-max", "SM clock MHz, min-max"):
        t.add_column(c)
    for name, s in spread.items():
        m = s["medians_ms"]
        if "cv" not in s:
            t.add_row(name, str(len(m)), "-", "-", "-", "-", f"< {s['target_cv']:.0%}", f"error: {s['error'][:200]}")
            continue
        verdict = ("PASS" if s["cv"] < s["target_cv"] else "FAIL") if cuda else "n/a (CPU)"
        o = [x / 1e3 for x in s.get("overheads_ns", []) if x is not None]
        t.add_row(name, str(len(m)), sig4(statistics.median(m)), sig4(min(m)), sig4(max(m)), f"{s['cv']:.2%}",
                  f"< {s['target_cv']:.0%}", verdict,
                  f"{s['cv_with_overhead']:.2%}" if "cv_with_overhead" in s else "-",
                  f"{min(o):.2f}-{max(o):.2f}" if o else "-",
                  f"{min(c):.0f}-{max(c):.0f}" if (c := [x for pair in s.get("sm_clocks_mhz", []) for x in pair if x])
                  else "-")
    return t


# -- main ------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", help="comma-separated problem names (default: all)")
    ap.add_argument("--out", type=Path, help="write every raw number to this JSON file")
    ap.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute")
    ap.add_argument("--ncu-cache-control", choices=("all", "none"), default="all",
                    help="Nsight Compute's --cache-control (default all: what the acceptance compares with)")
    ap.add_argument("--quick", action="store_true", help="fewer calls and spread jobs (a plumbing check)")
    ap.add_argument("--spread", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the spread over separate profile jobs (default: on)")
    ap.add_argument("--target", choices=("auto", "cuda", "cpu"), default="auto")
    args = ap.parse_args()
    try:
        problems = problems_by_name(args.problems.split(",") if args.problems else None)
    except KeyError as e:
        ap.error(str(e))
    if args.target == "cuda" and gpu_count() == 0:
        sys.exit("no NVIDIA GPU is visible (nvidia-smi/NVML found none): use --target cpu --no-ncu")
    target = resolve_target(args.target)
    cuda = target == Target.CUDA
    args.target = target.value
    if not cuda:
        progress("CPU target (no GPU): cudagym's times and the wall clock only; no ncu, do_bench or events")
    console = Console(width=max(shutil.get_terminal_size().columns, 220))
    results: dict[str, dict[str, Any]] = {p.name: {"time_class": p.time_class, "expected_us": p.expected_us}
                                          for p in problems}
    spread: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    report: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                              "cpu_count": os.cpu_count(), "target": target.value, "argv": sys.argv[1:],
                              "phases_done": [], "problems": results, "spread": spread, "notes": notes}
    if not cuda and not args.no_ncu:
        notes.append("Nsight Compute needs a GPU: no ncu columns on the CPU target")
    t_start = time.perf_counter()

    def save() -> None:
        """Write what is measured so far (a run killed later keeps it)."""
        report["seconds"] = time.perf_counter() - t_start
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))

    def done(phase: str) -> None:
        report["phases_done"].append(phase)
        save()

    work = Path(tempfile.mkdtemp(prefix="cudagym-bench-baselines-"))
    try:
        report["device"] = asyncio.run(cudagym_phase(args, problems, work / "cache", results, spread, save))
        done("cudagym")
        direct_phase(target, problems, 20 if args.quick else 100, work, results, notes)
        done("direct")
        if cuda and not args.no_ncu:
            calls = 5 if args.quick else 20
            progress(f"[ncu] one Nsight Compute run over {len(problems)} problems, {calls} calls each")
            try:
                report["ncu_version"], by_problem = ncu_phase(problems, calls, work, args.ncu_cache_control)
                for name, n in by_problem.items():
                    results[name].update(n)
            except RuntimeError as e:
                notes.append(f"Nsight Compute: {e}")
            done("ncu")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    console.print(f"device: {report['device']}; torch {torch.__version__}; {len(problems)} problems; "
                  f"{report['seconds']:.0f} s")
    console.print(main_table(problems, results, cuda))
    for label, single in (("single-kernel problems passing (eager and candidate within max(10%, 2 µs) of ncu)", True),
                          ("multi-kernel problems passing (within 10% + 2 µs per kernel of ncu's sum)", False)):
        judged = [v for p in problems if (results[p.name].get("kernels_per_call") == [1]) == single
                  and (v := acceptance(results[p.name])[0]) is not None]
        if judged:
            console.print(f"{label}: {sum(judged)}/{len(judged)}")
    if spread:
        console.print(spread_table(spread, cuda))
    for n in notes:
        console.print(f"note: {n}")
    if args.out:
        progress(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
