"""Does the timer's calibration read the same overhead when its calls end their launch window
once launched (`DeviceTimer.calibrate(release_early=True)`, protocol 13) as with the whole window
(protocol 12)? One process, one timer, the two alternated `--rounds` times: each calibration's
seconds and fields, then small ops timed under each (median of `--calls` calls, ms).

    python benchmarks/probe_calibration_window.py [--rounds 4] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from cudagym.sandbox.protocol import Calibration
from cudagym.sandbox.timing.timer import DeviceTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = DeviceTimer(dev, calibration=Calibration(0, 0))
    x = torch.randn(16, 16384, device=dev)
    g = torch.randn(16 * 16384 // 4, device=dev)  # 1 MB
    ops = {"relu_16x16384": (torch.relu, x), "gelu_1MB": (torch.nn.functional.gelu, g),
           "softmax_16x16384": (lambda t: torch.softmax(t, -1), x)}

    def timed(fn: Callable[[torch.Tensor], torch.Tensor], arg: torch.Tensor) -> float:
        ms = [timer.call(fn, [arg], lambda out: timer.read_at_end(out))[1] for _ in range(args.calls)]
        return statistics.median(ms)

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows: dict[str, list[tuple[float, Calibration, dict[str, float]]]] = {"early": [], "whole": []}
    for _ in range(args.rounds):
        for mode in ("whole", "early"):
            t0 = time.perf_counter()
            cal = timer.calibrate(release_early=mode == "early")
            secs = time.perf_counter() - t0
            rows[mode].append((secs, cal, {name: timed(fn, a) for name, (fn, a) in ops.items()}))
    for mode, got in rows.items():
        for secs, cal, times in got:
            print(f"{mode:6s} calibration {secs:.3f} s  overhead {cal.overhead_ns} ns  read cap {cal.read_cap_ns} ns  "
                  + "  ".join(f"{k} {v * 1e3:.2f} us" for k, v in times.items()))
    for mode, got in rows.items():
        print(f"{mode:6s} p50: calibration {statistics.median(g[0] for g in got):.3f} s, overhead "
              f"{statistics.median(g[1].overhead_ns for g in got):.0f} ns, "
              + ", ".join(f"{k} {statistics.median(g[2][k] for g in got) * 1e3:.2f} us" for k in ops))


if __name__ == "__main__":
    main()
