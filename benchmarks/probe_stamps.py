"""Which interval of the gated timer is steady from one fresh process to the next.

Each of `--processes` fresh processes (as each profile job is) builds each problem of
`timing_problems.py` and makes `--calls` calls of it through `DeviceTimer.call`, each followed by
a call of the harness's probe (a 4-byte fill), their outputs read at the end as the harness reads
them. For every call it keeps the events' interval and the gate kernels' device-clock stamps
(`DeviceTimer.stamps_ns`): the open gate's end, the close gate's first and last block arriving,
its last block leaving. Per process and interval: the problem's median less the probe's (plus
the fill's own time, from events around it on the caller's stream), and the SM clock (NVML).
Printed: each interval's median and CV across processes, and the smallest step of the stamps.
`--sets` and `--spacers` vary the input sets and the placement of what each call allocates.

Measured (10 processes, 2026-11-25): on an H100 the calls' own intervals varied 0.2-0.3 µs
across processes, the same way for relu and softmax in one process, while the 4-byte fill timed
by events around it (the calibration then) varied 1 µs and read 4.8-6.5 µs for its own time;
the stamped probe's calibration varied 0.11-0.19 µs. Softmax 16x16384 less the separate timer's
overhead: CV 3.5% with 4 input sets, 3.4% with 8 placements, 3.4% with 16 sets, 2.5% with both.
On an H200 a probe whose output is hot at the close read 2.8 µs more overhead on the job's own
timer than on a separate one without the flush. The overheads printed: `separate` (the
harness's: a separate timer without the flush), `own` (the timer that times the calls, its
flush included), `empty` and `empty_read` (the timer's interval around a call that launches
nothing, without and with a cold output read at the close: candidates for an overhead that
leaves a kernel's own launch on the GPU in its time, as Nsight Compute does).

Usage: python benchmarks/probe_stamps.py [--problems softmax_16x16384,...] [--processes 10] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from timing_problems import problems_by_name  # this folder's module

HERE = Path(__file__).resolve().parent
INTERVALS = ("events", "open_end>close_first", "open_end>close_last", "open_end>close_exit")
SPACER_BYTES = [0, 2**18, 2**19, 3 * 2**18, 2**20, 3 * 2**19, 5 * 2**19, 2**22]
DEFAULT = "relu_16x16384,softmax_16x16384,sum_16x16384,add_relu_scale_16x1024,mlp_tiny_b8,layernorm_4096x4096"


def _intervals(timer, ms: float) -> list[float]:
    """The call's intervals in µs (see INTERVALS)."""
    o, first, last, leave = timer.stamps_ns[:4]
    return [ms * 1e3, (first - o) / 1e3, (last - o) / 1e3, (leave - o) / 1e3]


def child(names: list[str], calls: int, n_sets: int, spacers: int) -> None:
    import torch

    from cudagym.sandbox.timing import DeviceTimer, harness_overhead_ns

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        clock = lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)  # noqa: E731
    except Exception:  # noqa: BLE001
        clock = lambda: 0  # noqa: E731
    separate_ns = harness_overhead_ns.__wrapped__()
    timer = DeviceTimer(torch.device("cuda"), overhead_ns=0)
    own_ns = timer.calibrate()
    timer.overhead_ns = 0
    cold = torch.zeros(2048, device="cuda")  # never written by a call: cold after the flush

    def empty_call_us(read_cold: bool) -> float:
        """The timer's interval around a call that launches nothing (µs, median of 100)."""
        after = (lambda _: timer.read_at_end(cold)) if read_cold else None
        return statistics.median(timer.call(lambda: None, [], after)[1] for _ in range(100)) * 1e3

    empty_us, empty_read_us = empty_call_us(False), empty_call_us(True)
    probe_buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    own: list[float] = []

    def fill() -> torch.Tensor:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        probe_buf.zero_()
        e.record()
        own.append((s, e))
        return probe_buf

    def read(out) -> None:
        for o in out if isinstance(out, (list, tuple)) else [out]:
            timer.read_at_end(o)

    result = {"separate_overhead_us": separate_ns / 1e3, "own_overhead_us": own_ns / 1e3,
              "empty_overhead_us": empty_us, "empty_read_overhead_us": empty_read_us, "problems": {}}
    steps: set[int] = set()
    for problem in problems_by_name(names):
        scope: dict = {}
        exec(problem.source, scope)  # noqa: S102 - the benchmark's own problems
        model = scope["Model"](*scope["get_init_inputs"]()).cuda().eval()
        sets = [[x.cuda() for x in scope["get_inputs"]()] for _ in range(n_sets)]
        real, probe = [], []
        clocks = [clock()]
        own.clear()
        with torch.no_grad():
            for i in range(calls + 10):
                # an allocation of one of `spacers` sizes held across the call: its output lands elsewhere
                spacer = torch.empty(SPACER_BYTES[(i // n_sets) % spacers], dtype=torch.uint8, device="cuda")
                _, ms = timer.call(model, sets[i % n_sets], read)
                del spacer
                r = _intervals(timer, ms)
                _, ms = timer.call(fill, [], read)
                p = _intervals(timer, ms)
                if i >= 10:
                    real.append(r)
                    probe.append(p)
                    steps.update(int(round(x * 1e3)) % 1000 for x in r[1:3])
        clocks.append(clock())
        fill_us = statistics.median(s.elapsed_time(e) for s, e in own[10:]) * 1e3
        result["problems"][problem.name] = {
            "real": [statistics.median(c[k] for c in real) for k in range(len(INTERVALS))],
            "probe": [statistics.median(c[k] for c in probe) for k in range(len(INTERVALS))],
            "fill_us": fill_us, "clock_mhz": clocks}
        del model, sets
    result["stamp_residues_ns"] = sorted(steps)[:20]
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default=DEFAULT)
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sets", type=int, default=4, help="input sets per problem, used in turn")
    ap.add_argument("--spacers", type=int, default=1, choices=range(1, 9),
                    help="allocations of this many sizes held across calls in turn (1: none)")
    ap.add_argument("--out", help="raw per-process results as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.problems.split(",")
    if args.child:
        return child(names, args.calls, args.sets, args.spacers)
    runs = []
    for p in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--child", "--problems", args.problems, "--calls", str(args.calls),
                              "--sets", str(args.sets), "--spacers", str(args.spacers)],
                             capture_output=True, text=True, cwd=HERE)
        if out.returncode:
            sys.exit(f"process {p} failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"[probe] process {p}: stamp residues {runs[-1]['stamp_residues_ns'][:8]}", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    cv = lambda xs: statistics.pstdev(xs) / statistics.fmean(xs) if statistics.fmean(xs) else float("nan")  # noqa: E731
    print("overheads µs, separate timer:", " ".join(f"{r['separate_overhead_us']:.2f}" for r in runs))
    for key in ("own_overhead_us", "empty_overhead_us", "empty_read_overhead_us"):
        print(f"overheads µs, {key[:-12]}:".ljust(30), " ".join(f"{r[key]:.2f}" for r in runs))
    print(f"{'problem':<24} {'interval':<22} {'raw µs':>8} {'raw CV':>7} {'probe µs':>9} {'probe sd':>8} "
          f"{'net µs':>8} {'net CV':>7} {'net sd µs':>9}")
    for name in names:
        rows = [r["problems"][name] for r in runs]
        for k, interval in enumerate(INTERVALS):
            raw = [r["real"][k] for r in rows]
            probe = [r["probe"][k] for r in rows]
            net = [r["real"][k] - r["probe"][k] + r["fill_us"] for r in rows]
            print(f"{name:<24} {interval:<22} {statistics.median(raw):8.3f} {cv(raw):7.2%} {statistics.median(probe):9.3f} "
                  f"{statistics.pstdev(probe):8.3f} {statistics.median(net):8.3f} {cv(net):7.2%} {statistics.pstdev(net):9.3f}")
        expected = problems_by_name([name])[0].expected_us
        for key in ("separate_overhead_us", "own_overhead_us", "empty_overhead_us", "empty_read_overhead_us"):
            net = [r["real"][0] - runs[i][key] for i, r in enumerate(rows)]
            cal = [run[key] for run in runs]
            print(f"{name:<24} {'events-' + key[:-12]:<22} {'':>8} {'':>7} {statistics.median(cal):9.3f} "
                  f"{statistics.pstdev(cal):8.3f} {statistics.median(net):8.3f} {cv(net):7.2%} {statistics.pstdev(net):9.3f}"
                  f"  (H100 ncu ~{expected} µs)")
        clocks = [c for r in rows for c in r["clock_mhz"]]
        print(f"{name:<24} SM clock MHz {min(clocks)}-{max(clocks)}; fill µs {statistics.median(r['fill_us'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
