"""Where a small call's inflated times come from: the host's launch against the launch window.

One process, no sandbox: `DeviceTimer.call` on a few problems of `timing_problems.py`, each
call's time next to its host span (`DeviceTimer.host_ms`: open kernel launched to close kernel
launched). A call whose host span passes the launch window has host work in its time. Variants:
the timer alone; with the op counter armed around each call (as the harness runs it); with a
round trip to another process between calls (as the harness asks the parent for each call),
answered by a blocking read or a polled one; a longer window. Prints one table; GPU only. About a minute on an H100.

Usage: python benchmarks/probe_launch_window.py [--calls 300] [--problems a,b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cudagym.sandbox.opwatch import OpWatch
from cudagym.sandbox.timing import DeviceTimer, harness_calibration
from timing_problems import problems_by_name  # this folder's module

DEFAULT = "relu_16x16384,add_relu_scale_16x1024,mlp_tiny_b8,softmax_16x16384"


class Echo:
    """A child process that answers each line with the same line: the parent's round trip."""

    def __init__(self, spin: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.out = self.proc.stdout.fileno()
        self.spin = spin
        os.set_blocking(self.out, not spin)

    def __call__(self) -> None:
        self.proc.stdin.write(b"next\n")
        self.proc.stdin.flush()
        while True:
            try:
                if os.read(self.out, 64):
                    return
            except BlockingIOError:
                continue


ECHO = "import sys\nfor line in sys.stdin.buffer:\n    sys.stdout.buffer.write(line); sys.stdout.buffer.flush()"


def run(model: torch.nn.Module, inputs: list[torch.Tensor], calls: int, window_us: float,
        watch: OpWatch | None, between: Echo | None = None) -> list[tuple[float, float]]:
    timer = DeviceTimer(torch.device("cuda"), launch_window_us=window_us, calibration=harness_calibration())

    def fn(*args: torch.Tensor) -> torch.Tensor:
        if watch is not None:
            watch.arm()
        try:
            return model(*args)
        finally:
            if watch is not None:
                watch.disarm()

    pairs = []
    with torch.no_grad():
        for i in range(calls + 20):
            if between is not None:
                between()
            _, ms = timer.call(fn, inputs)
            if i >= 20:
                pairs.append((ms, timer.host_ms or 0.0))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--problems", default=DEFAULT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_launch_window.py needs a GPU")
    watch = OpWatch.load(Path(tempfile.mkdtemp()))
    blocking, polled = Echo(spin=False), Echo(spin=True)
    table = Table(title=f"{torch.cuda.get_device_name()}: call time vs host span, {args.calls} calls each")
    for col in ("problem", "variant", "median ms", "p90 ms", "host p50 ms", "host p90 ms", "late calls",
                "median ms (late)", "median ms (on time)"):
        table.add_column(col)
    for problem in problems_by_name(args.problems.split(",")):
        scope: dict = {}
        exec(problem.source, scope)  # noqa: S102 - the benchmark's own problems
        model = scope["Model"](*scope["get_init_inputs"]()).cuda().eval()
        inputs = [x.cuda() for x in scope["get_inputs"]()]
        for variant, window, w, between in (
                ("timer", 200.0, None, None), ("timer+opwatch", 200.0, watch, None),
                ("timer+opwatch+round trip (blocking read)", 200.0, watch, blocking),
                ("timer+opwatch+round trip (polled read)", 200.0, watch, polled),
                ("timer+opwatch, 1000 µs window", 1000.0, watch, None)):
            pairs = run(model, inputs, args.calls, window, w, between)
            ms = sorted(p[0] for p in pairs)
            host = sorted(p[1] for p in pairs)
            late = [p[0] for p in pairs if p[1] > window / 1e3]
            on_time = [p[0] for p in pairs if p[1] <= window / 1e3]
            table.add_row(problem.name, variant, f"{statistics.median(ms):.5f}", f"{ms[int(0.9 * len(ms))]:.5f}",
                          f"{statistics.median(host):.4f}", f"{host[int(0.9 * len(host))]:.4f}", str(len(late)),
                          f"{statistics.median(late):.5f}" if late else "-",
                          f"{statistics.median(on_time):.5f}" if on_time else "-")
            print(f"[probe] {problem.name} {variant}: done", file=sys.stderr, flush=True)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
