"""Which overhead puts the gated timer's one-kernel calls where Nsight Compute puts them, steadily
from one fresh process to the next.

Each of `--processes` fresh processes (as each profile job is) measures three calibrations, then
builds each problem of `timing_problems.py` and makes `--calls` calls of it through
`DeviceTimer.call` (uncalibrated), its outputs read at the close as the harness reads them. For
every call it keeps the events' interval and the gate kernels' device-clock stamps
(`DeviceTimer.stamps_ns`): the open gate's end, the close gate's first and last block arriving,
its last block leaving. The calibrations are calls that launch nothing: `empty_hot_sep` (the
harness's: a timer without the L2 flush, so the output the close reads is hot, as a call's is),
`empty_none_sep` (no output read) and `empty_cold_own` (the flushing timer, the output cold).
Printed per problem and calibration, the median across processes and the CV of: the events'
interval less the calibration's (`events`); the same, each less its read phase (`events-rp`: the
harness's reading); the span from the open gate's end to the close's last arrival (`span`).
`--sets` and `--spacers` vary the input sets and the placement of what each call allocates.

Measured (10 processes, 2026-11-25, H100, 16 sets, 8 placements): with the gates on a stream of
their own, relu 1x1024 / relu 16x16384 / softmax / sum / relu 512x16384 read 2.5 / 4.3 / 9.3 /
6.7 / 22.2 us against Nsight Compute's 2.8 / 3.3 / 8.6 / 7.3 / 20.2 (overhead: a probe kernel's
interval less its stamped own time); with the gates moved onto the caller's stream by hand,
`events-rp` with `empty_hot_sep` read 2.78 / 3.18 / 8.45 / 7.10 / 20.20, CV 2.7 / 2.5 / 0.9 / 1.0 /
0.4%; with the timer as it is now (6 processes, another H100 machine) 3.46 / 3.90 / 9.17 / 7.80 /
20.97, CV 2.0 / 0.7 / 0.5 / 0.6 / 0.3%.

Usage: python benchmarks/probe_stamps.py [--problems softmax_16x16384,...] [--processes 10] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from timing_problems import problems_by_name  # this folder's module

HERE = Path(__file__).resolve().parent
SPACER_BYTES = [0, 2**18, 2**19, 3 * 2**18, 2**20, 3 * 2**19, 5 * 2**19, 2**22]
DEFAULT = "relu_1x1024,relu_16x16384,softmax_16x16384,sum_16x16384,relu_512x16384"
KEYS = ("events", "read_phase", "span")


def _call_us(timer: Any, ms: float) -> list[float]:
    """The call's events interval, read phase and span (µs; see KEYS)."""
    o, _, last, leave = timer.stamps_ns
    return [ms * 1e3, (leave - last) / 1e3, (last - o) / 1e3]


def _medians(rows: list[list[float]]) -> list[float]:
    return [statistics.median(r[k] for r in rows) for k in range(len(KEYS))]


def child(names: list[str], calls: int, n_sets: int, spacers: int) -> None:
    import torch

    from cudagym.sandbox.timing import Calibration, DeviceTimer

    none = Calibration(0, 0)
    separate = DeviceTimer(torch.device("cuda"), flush_l2=False, calibration=none)
    timer = DeviceTimer(torch.device("cuda"), calibration=none)
    cold = torch.zeros(2048, device="cuda")  # never written by a call: cold after the flush
    hot = torch.zeros(1 << 18, device="cuda")  # read by calls of the timer without the flush: hot

    def calibration(t: DeviceTimer, read: torch.Tensor | None) -> list[float]:
        after = (lambda _: t.read_at_end(read)) if read is not None else None
        rows = [_call_us(t, t.call(lambda: None, [], after)[1]) for _ in range(110)]
        return _medians(rows[10:])

    result = {"calibrations": {"empty_hot_sep": calibration(separate, hot),
                               "empty_none_sep": calibration(separate, None),
                               "empty_cold_own": calibration(timer, cold)},
              "harness": list(separate.calibrate()), "problems": {}}

    def read(out: Any) -> None:
        for o in out if isinstance(out, (list, tuple)) else [out]:
            timer.read_at_end(o)

    for problem in problems_by_name(names):
        scope: dict = {}
        exec(problem.source, scope)  # noqa: S102 - the benchmark's own problems
        model = scope["Model"](*scope["get_init_inputs"]()).cuda().eval()
        sets = [[x.cuda() for x in scope["get_inputs"]()] for _ in range(n_sets)]
        rows = []
        with torch.no_grad():
            for i in range(calls + 10):
                # an allocation of one of `spacers` sizes held across the call: its output lands elsewhere
                spacer = torch.empty(SPACER_BYTES[(i // n_sets) % spacers], dtype=torch.uint8, device="cuda")
                _, ms = timer.call(model, sets[i % n_sets], read)
                del spacer
                rows.append(_call_us(timer, ms))
        rows = rows[10:]
        result["problems"][problem.name] = {"medians": _medians(rows),
                                            "net_rp": statistics.median(r[0] - r[1] for r in rows)}
        del model, sets
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default=DEFAULT)
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sets", type=int, default=16, help="input sets per problem, used in turn")
    ap.add_argument("--spacers", type=int, default=8, choices=range(1, 9),
                    help="allocations of this many sizes held across calls in turn (1: none)")
    ap.add_argument("--out", help="raw per-process results as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.problems.split(",")
    if args.child:
        return child(names, args.calls, args.sets, args.spacers)
    runs = []
    for p in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--child", "--problems", args.problems,
                              "--calls", str(args.calls),
                              "--sets", str(args.sets), "--spacers", str(args.spacers)],
                             capture_output=True, text=True, cwd=HERE)
        if out.returncode:
            sys.exit(f"process {p} failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"[probe] process {p} done", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    cv = lambda xs: statistics.pstdev(xs) / statistics.fmean(xs) if statistics.fmean(xs) else float("nan")  # noqa: E731
    print("harness calibration (overhead, read cap) ns:", " ".join("/".join(map(str, r["harness"])) for r in runs))
    for cal in runs[0]["calibrations"]:
        print(f"calibration {cal} (events, read phase, span) µs:",
              " ".join("/".join(f"{v:.2f}" for v in r["calibrations"][cal]) for r in runs))
    for name in names:
        expected = problems_by_name([name])[0].expected_us
        for cal in runs[0]["calibrations"]:
            c = [r["calibrations"][cal] for r in runs]
            p = [r["problems"][name] for r in runs]
            ev = [x["medians"][0] - y[0] for x, y in zip(p, c)]
            nrp = [x["net_rp"] - (y[0] - y[1]) for x, y in zip(p, c)]
            span = [x["medians"][2] - y[2] for x, y in zip(p, c)]
            print(
                f"{name:<20} {cal:<15} events {statistics.median(ev):7.3f} ({cv(ev):6.2%})  events-rp "
                f"{statistics.median(nrp):7.3f} ({cv(nrp):6.2%})  span {statistics.median(span):7.3f} ({cv(span):6.2%})"
                f"  H100 ncu ~{expected}"
            )


if __name__ == "__main__":
    main()
