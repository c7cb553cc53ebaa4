"""Host time per op of a tiny ATen op under each op watcher, against no watcher in the same process.

Each watcher gets a fresh process that times `torch.add(a, b)` on 4-element tensors (`--device`):
`--rounds` rounds of `--calls` back-to-back calls, timed around the whole round with the
thread's CPU time (`--clock cpu`, the default: other processes on a shared machine do not count)
or `perf_counter_ns` (`--clock wall`); the Python loop's own cost is in every figure. A round
with the watcher alternates with a round without it. The opwatch callback cannot be removed
once installed: its process first times rounds before installing it, then alternates rounds
with RecordFunction switched off for the thread (the dispatcher then runs no callback, as with
none installed; the two baselines should agree) with rounds disarmed and armed. On CUDA the
figure is the host's launch time: the device is synchronized after each round, outside the
timer. Prints the median and the minimum ns per op over the rounds, the IQR, and the ratio
of medians to the same process's alternating baseline ("no watcher").

Watchers: opwatch installed but disarmed; opwatch armed; a `TorchDispatchMode` counter (the
harness's `OpRecorder`); a `torch.profiler.profile(activities=[CPU])` session.

Usage: python benchmarks/bench_opwatch.py [--device cpu|cuda] [--rounds N] [--calls N] [--clock cpu|wall]
           [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = {
    "opwatch": "opwatch installed, disarmed / armed",
    "dispatch_mode": "TorchDispatchMode counter (OpRecorder)",
    "profiler": "torch.profiler, CPU activity",
}
CLOCKS: dict[str, Callable[[], int]] = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


def measure(condition: str, device: str, rounds: int, calls: int, cache_dir: Path,
            clock: Callable[[], int]) -> dict[str, list[float]]:
    """{label: ns per op of each round} for one watcher, in this process."""
    import torch

    a, b = torch.randn(4, device=device), torch.randn(4, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def ns_per_op() -> float:
        """One round of `calls` calls of the op."""
        t0 = clock()
        for _ in range(calls):
            torch.add(a, b)
        dt = clock() - t0
        sync()
        return dt / calls

    for _ in range(3):  # warm caches, the allocator, and CUDA's lazy init
        ns_per_op()
    out: dict[str, list[float]] = {"no watcher": []}
    if condition == "opwatch":
        from cudagym.sandbox.opwatch import OpWatch

        out["no watcher, before install"] = [ns_per_op() for _ in range(rounds)]
        watch = OpWatch.load(cache_dir)
        out["opwatch disarmed"], out["opwatch armed"] = [], []
        watch.reset()
        for _ in range(rounds):
            # RecordFunction off for this thread: the dispatcher skips every callback, as it does
            # with none installed, so the baseline can alternate with the watcher here too
            torch.autograd._enable_record_function(False)
            out["no watcher"].append(ns_per_op())
            torch.autograd._enable_record_function(True)
            out["opwatch disarmed"].append(ns_per_op())
            watch.arm()
            out["opwatch armed"].append(ns_per_op())
            watch.disarm()
        counted = watch.counts()["aten::add"]
        if counted != rounds * calls:  # the figure is only meaningful if it counted every op
            raise SystemExit(f"opwatch counted {counted} of {rounds * calls} ops")
        return out

    def watcher() -> AbstractContextManager[object]:
        if condition == "dispatch_mode":
            from cudagym.sandbox.worker.integrity import OpRecorder

            return OpRecorder()
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU])

    label = CONDITIONS[condition]
    out[label] = []
    for _ in range(rounds):
        out["no watcher"].append(ns_per_op())
        with watcher():
            out[label].append(ns_per_op())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--clock", default="cpu", choices=list(CLOCKS),
                    help="cpu: this thread's CPU time (robust on a shared machine); wall: perf_counter")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "cudagym-bench-opwatch")
    ap.add_argument("--condition", choices=list(CONDITIONS), help=argparse.SUPPRESS)  # one child process
    args = ap.parse_args()
    if args.condition:
        result = measure(args.condition, args.device, args.rounds, args.calls, args.cache_dir, CLOCKS[args.clock])
        print(json.dumps(result))
        return

    from cudagym.sandbox.opwatch import build_library

    build_library(args.cache_dir)  # outside any measurement
    table = Table(title=f"torch.add of 4-element tensors on {args.device}: host ns per op ({args.clock} clock), "
                        f"median of {args.rounds} rounds of {args.calls} calls")
    for c in ("process", "watcher", "median ns/op", "min ns/op", "IQR ns", "x no watcher"):
        table.add_column(c)
    for condition in CONDITIONS:
        r = subprocess.run([sys.executable, __file__, "--condition", condition, "--device", args.device,
                            "--rounds", str(args.rounds), "--calls", str(args.calls), "--clock", args.clock,
                            "--cache-dir", str(args.cache_dir)],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        result: dict[str, list[float]] = json.loads(r.stdout.strip().splitlines()[-1])
        base = statistics.median(result["no watcher"])
        for label, times in result.items():
            q = statistics.quantiles(times, n=4)
            median = statistics.median(times)
            table.add_row(condition, label, f"{median:.0f}", f"{min(times):.0f}", f"{q[2] - q[0]:.0f}",
                          f"{median / base:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
