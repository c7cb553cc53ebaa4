"""Runs the timing benchmark's problems in this process, outside cudagym (`bench_baselines.py`
starts it; it writes its results as JSON to `--out`).

Each problem is built as KernelBench builds one: `Model(*get_init_inputs())` and
`get_inputs()` on the host, then moved to the device; float32 matrix products and convolutions
without TF32 (as cudagym's harness pins them); no autograd. Problems run one after another,
each freed before the next.

Modes:
- `ncu`: to run under `ncu --profile-from-start off`. Per problem: `WARMUP_CALLS` calls
  outside the profiled range, then `cudaProfilerStart`, `--calls` times (forward call, one
  marker kernel), `cudaProfilerStop`. So ncu's log holds, in launch order, each call's kernels
  followed by a marker (torch's `spin_kernel`, which no problem launches): the kernels between
  two markers are one call's. The JSON lists the problems and their profiled calls in order.
- `direct` on a GPU: Triton's `do_bench(fn, return_mode="median")` (it flushes L2 itself) and
  the KernelBench-style timing: `WARMUP_CALLS` calls, then `--calls` times (start event, call,
  end event, `torch.cuda.synchronize()`), L2 not flushed; per-call times in ms.
- `direct` on the CPU: the wall clock around each of `--calls` calls after the warm-up (ms).

Usage: python benchmarks/timing_driver.py {ncu,direct} --target {cuda,cpu} --problems a,b --calls N --out F
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import types
from typing import Any

import torch

from cudagym.tasks.model import Target
from timing_problems import TimingProblem, problems_by_name  # this folder's module

WARMUP_CALLS = 3
MARKER_KERNEL = "spin_kernel"  # the kernel of `torch.cuda._sleep`
MARKER_CYCLES = 1000  # under a microsecond of spinning


def build(problem: TimingProblem, device: torch.device) -> tuple[torch.nn.Module, list[Any]]:
    """The problem's model and inputs on `device`, at the sizes of the device's target."""
    target = Target.CUDA if device.type == "cuda" else Target.CPU
    module = types.ModuleType(f"timing_problem_{problem.name}")
    code = problem.task().for_target(target).code
    exec(compile(code, f"<problem {problem.name}>", "exec"), module.__dict__)  # noqa: S102 - our own problems
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).to(device)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in module.get_inputs()]
    return model, inputs


def run_ncu(model: torch.nn.Module, inputs: list[Any], calls: int, entry: dict[str, Any]) -> None:
    """Warm up, then profile `calls` calls, each closed by a marker; `entry["calls"]` counts the
    markers launched, also when a call raises (a call cut short is closed by its marker too)."""
    for _ in range(WARMUP_CALLS):
        model(*inputs)
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    entry["calls"] = 0
    cudart.cudaProfilerStart()
    try:
        for _ in range(calls):
            try:
                model(*inputs)
            finally:
                torch.cuda._sleep(MARKER_CYCLES)
                entry["calls"] += 1
        torch.cuda.synchronize()
    finally:
        cudart.cudaProfilerStop()


def events_ms(fn: Any, calls: int) -> list[float]:
    """Each call's time (ms) by CUDA events right around it, then a synchronize (KernelBench's way)."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run_direct(model: torch.nn.Module, inputs: list[Any], calls: int, device: torch.device) -> dict[str, Any]:
    def fn() -> Any:
        return model(*inputs)

    for _ in range(WARMUP_CALLS):
        fn()
    if device.type != "cuda":
        wall_ms = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            wall_ms.append((time.perf_counter() - t0) * 1e3)
        return {"wall_ms": wall_ms}
    torch.cuda.synchronize()
    out: dict[str, Any] = {"events_ms": events_ms(fn, calls)}
    try:
        from triton.testing import do_bench
    except ImportError as e:
        out["do_bench_error"] = f"triton is not importable: {e}"
    else:
        out["do_bench_ms"] = float(do_bench(fn, return_mode="median"))
    return out


def measure(problem: TimingProblem, mode: str, calls: int, device: torch.device, entry: dict[str, Any]) -> None:
    """Build the problem and measure it into `entry` (its tensors are freed on return)."""
    model, inputs = build(problem, device)
    if mode == "ncu":
        run_ncu(model, inputs, calls, entry)
    else:
        entry.update(run_direct(model, inputs, calls, device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("ncu", "direct"))
    ap.add_argument("--target", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--problems", required=True, help="comma-separated problem names")
    ap.add_argument("--calls", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda:0" if args.target == "cuda" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    results: list[dict[str, Any]] = []
    for problem in problems_by_name(args.problems.split(",")):
        entry: dict[str, Any] = {"problem": problem.name}
        results.append(entry)
        try:
            measure(problem, args.mode, args.calls, device, entry)
        except Exception as e:  # noqa: BLE001 - one problem's failure is reported, the others still run
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{args.mode}] {problem.name}: {entry.get('error', 'done')}", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"mode": args.mode, "target": args.target, "results": results}, f)


if __name__ == "__main__":
    main()
