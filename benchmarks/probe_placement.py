"""Where a small kernel's job-to-job spread comes from: input placement, the L2 flush, the process.

Each of `--processes` fresh processes (as each profile job is) builds a problem of
`timing_problems.py`, allocates `--buffers` input sets and times `--rounds` calls on each
(`DeviceTimer.call`, round robin over the sets), with the timer's L2 flush, none, or a larger one
(`--flush`). Per process: the median of the calls on the first 4 sets (what a job with 4 input
sets measures), the median over all sets, and the range of the per-set medians; then the CV of
each median across processes, and how far the per-set medians differ beyond their sampling error.
GPU only; about 20 s per problem and flush on an H200.

Measured on an H200 (6-8 processes): relu and softmax 16x16384 per-set medians differ 2-5x their
sampling error, yet 16 or 32 sets instead of 4 leave the CV across processes about where it was
(softmax 5.1% -> 4.2%, relu 18.8% -> 17.2%), and so do flushes of 4x and 8x the L2 (softmax 7.0%,
3.5%, 4.0%; relu 20%, 21%, 20%); without any flush the CV is 2% (softmax) and 13% (relu). The
spread is a property of each process's memory placement, not of the flush or of the number of
input sets.

Usage: python benchmarks/probe_placement.py [--problems softmax_16x16384,sum_16x16384]
       [--processes 10] [--buffers 32] [--rounds 10] [--flush 0,4,none]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cudagym.sandbox.timing import CALIBRATION_CALLS, Calibration, DeviceTimer, harness_calibration
from timing_problems import problems_by_name  # this folder's module

HERE = Path(__file__).resolve().parent


def child(name: str, buffers: int, rounds: int, flush: str, calibration: int) -> None:
    """One fresh process: per-set lists of call times (ms) and two independent measurements of
    the harness's overhead (ns; `calibration` calls each): on the timer that times the calls, as
    a job does (`DeviceTimer.calibrate`), and on a separate timer without the flush, as jobs did
    before, as JSON on stdout."""
    separate = harness_calibration.__wrapped__().overhead_ns
    problem = problems_by_name([name])[0]
    scope: dict = {}
    exec(problem.source, scope)  # noqa: S102 - the benchmark's own problems
    model = scope["Model"](*scope["get_init_inputs"]()).cuda().eval()
    sets = [[x.cuda() for x in scope["get_inputs"]()] for _ in range(buffers)]
    timer = DeviceTimer(torch.device("cuda"), flush_l2=flush != "none", calibration=Calibration(0, 0))
    flush_x = 0.0 if flush == "none" else float(flush)
    if flush_x:  # the open gate reads this buffer: `flush_x` times the L2's size
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        timer._flush_buf = torch.zeros(int(flush_x * l2) // 8, dtype=torch.int64, device="cuda")
    overheads = [timer.calibrate(calibration).overhead_ns, separate]
    times: list[list[float]] = [[] for _ in sets]
    with torch.no_grad():
        for r in range(rounds + 1):
            for b, args in enumerate(sets):
                _, ms = timer.call(model, args)
                if r:  # the first round warms up
                    times[b].append(ms)
    print(json.dumps({"times": times, "overheads": overheads}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="softmax_16x16384,sum_16x16384")
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--buffers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--flush", default="0", help="comma-separated sizes of the L2 flush, in L2 sizes "
                    "(0: the timer's own, none: no flush)")
    ap.add_argument("--calibration", type=int, default=CALIBRATION_CALLS,
                    help="calls of each overhead measurement (default: the harness's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.buffers, args.rounds, args.flush, args.calibration)
    if not torch.cuda.is_available():
        sys.exit("probe_placement.py needs a GPU")
    summary = Table(title=f"{torch.cuda.get_device_name()}: job medians with 4 input sets vs {args.buffers}, "
                          f"{args.processes} fresh processes")
    for col in ("problem", "flush (× L2)", "median µs", "CV of 4-set medians", f"CV of {args.buffers}-set medians",
                "per-set medians, min-max µs", "per-set median sd / its sampling error", "CV, overhead left in",
                "CV, a separate timer's overhead left out",
                "own overhead µs, mean (sd across processes)", "separate timer's overhead µs, mean (sd)"):
        summary.add_column(col)
    for name, flush in [(n, f) for n in args.problems.split(",") for f in args.flush.split(",")]:
        four, every, spreads, ratios, raw, separate, overheads = [], [], [], [], [], [], []
        for p in range(args.processes):
            out = subprocess.run([sys.executable, __file__, "--child", name, "--buffers", str(args.buffers),
                                  "--rounds", str(args.rounds), "--flush", flush,
                                  "--calibration", str(args.calibration)],
                                 capture_output=True, text=True, cwd=HERE, check=True)
            answer = json.loads(out.stdout)
            times = answer["times"]
            overheads.append([o / 1e3 for o in answer["overheads"]])
            four.append(statistics.median([t for ts in times[:4] for t in ts]))
            every.append(statistics.median([t for ts in times for t in ts]))
            raw.append(every[-1] + overheads[-1][0] / 1e3)
            separate.append(raw[-1] - overheads[-1][1] / 1e3)
            medians = [statistics.median(ts) for ts in times]
            spreads.append((min(medians) * 1e3, max(medians) * 1e3))
            # the sampling error of one set's median, from the pooled within-set spread
            within = statistics.fmean(statistics.pstdev(ts) for ts in times) * 1.2533 / len(times[0]) ** 0.5
            ratios.append(statistics.pstdev(medians) / within if within else float("nan"))
            print(f"[probe] {name} flush {flush} process {p}: 4 sets {four[-1] * 1e3:.3f} µs, "
                  f"all {every[-1] * 1e3:.3f} µs, "
                  f"per-set {spreads[-1][0]:.2f}-{spreads[-1][1]:.2f} µs, overhead {overheads[-1][0]:.3f} µs "
                  f"(a separate timer's {overheads[-1][1]:.3f})", file=sys.stderr, flush=True)
        cv = lambda xs: statistics.pstdev(xs) / statistics.fmean(xs)  # noqa: E731
        summary.add_row(
            name,
            flush if flush != "0" else "timer's",
            f"{statistics.median(every) * 1e3:.3f}",
            f"{cv(four):.2%}",
            f"{cv(every):.2%}",
            f"{min(s[0] for s in spreads):.2f}-{max(s[1] for s in spreads):.2f}",
            f"{statistics.fmean(ratios):.1f}",
            f"{cv(raw):.2%}",
            f"{cv(separate):.2%}",
            f"{statistics.fmean(o[0] for o in overheads):.3f} ({statistics.pstdev(o[0] for o in overheads):.3f})",
            f"{statistics.fmean(o[1] for o in overheads):.3f} ({statistics.pstdev(o[1] for o in overheads):.3f})",
        )
    Console(width=200).print(summary)


if __name__ == "__main__":
    main()
