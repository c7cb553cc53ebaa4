"""How many calls, and how long a launch window, the timer's calibration needs: one process, one
timer, each setting (window us, no-op calls, large calls) calibrated `--rounds` times in turn;
each calibration's seconds and overhead, then small ops timed under it (median of `--calls`
calls, us). Timed calls keep the protocol's window whatever the calibration used.

    python benchmarks/probe_calibration.py [--rounds 4] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import cudagym.sandbox.timing.timer as timer_module
from cudagym.sandbox.protocol import Calibration
from cudagym.sandbox.timing.timer import DeviceTimer

# (window us, no-op calls per block, large calls, blocks): protocol 12's calibration, then 13's
SETTINGS = ((1000, 100, 10, 1), (300, 40, 5, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = DeviceTimer(dev, calibration=Calibration(0, 0))
    x = torch.randn(16, 16384, device=dev)
    g = torch.randn(16 * 16384 // 4, device=dev)
    ops: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {
        "relu_16x16384": (torch.relu, x), "gelu_1MB": (torch.nn.functional.gelu, g),
        "softmax_16x16384": (lambda t: torch.softmax(t, -1), x)}

    def timed(fn: Callable[[torch.Tensor], torch.Tensor], arg: torch.Tensor) -> float:
        ms = [timer.call(fn, [arg], lambda out: timer.read_at_end(out))[1] for _ in range(args.calls)]
        return statistics.median(ms) * 1e3

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    got: dict[tuple[int, int, int, int], list[tuple[float, Calibration, dict[str, float]]]] = {
        s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for window_us, calls, large, blocks in SETTINGS:
            timer_module.CALIBRATION_WINDOW_US, timer_module.CALIBRATION_BLOCKS = window_us, blocks
            timer_module.LARGE_CALIBRATION_CALLS = large
            t0 = time.perf_counter()
            cal = timer.calibrate(calls)
            secs = time.perf_counter() - t0
            got[(window_us, calls, large, blocks)].append((secs, cal, {k: timed(fn, a) for k, (fn, a) in ops.items()}))
    for s, runs in got.items():
        for secs, cal, t in runs:
            print(f"window {s[0]:4d} us, {s[3]}x{s[1]:3d}+{s[2]:2d} calls: {secs:.3f} s, "
                  f"overhead {cal.overhead_ns} ns, "
                  f"read cap {cal.read_cap_ns} ns, " + ", ".join(f"{k} {v:.2f} us" for k, v in t.items()))
    for s, runs in got.items():
        print(f"p50 window {s[0]:4d} us, {s[3]}x{s[1]:3d}+{s[2]:2d} calls: "
              f"{statistics.median(r[0] for r in runs):.3f} s, "
              f"overhead {statistics.median(r[1].overhead_ns for r in runs):.0f} ns "
              f"(min {min(r[1].overhead_ns for r in runs)}, max {max(r[1].overhead_ns for r in runs)}), "
              + ", ".join(f"{k} {statistics.median(r[2][k] for r in runs):.2f} us" for k in ops))


if __name__ == "__main__":
    main()
