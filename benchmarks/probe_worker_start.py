"""Where a worker's start-up time goes, and what a fork from a warm parent would save.

Rows:
- "spawned, n at once": n spares of the real `LocalSandbox` started together (nice, no
  freeze: nothing is timed meanwhile), each one's steps on its own clock (the ready frame's
  `startup_s`) and its wall time from spawn to ready; p50 / max over the n.
- "forked, n at once": an experiment, not the sandbox. This process imports torch and the
  harness and runs the CPU part of the prewarm (no CUDA call of any kind), then forks n
  children at once; each creates its CUDA context, runs the profiler's first CUDA session,
  loads the timer's gate kernels, opens NVML and page-locks 512 MB (what a spawned worker does
  after its imports), then runs one kernel and checks its result. torch's availability check
  goes through NVML here (PYTORCH_NVML_BASED_CUDA_CHECK=1): its default touches the driver, and
  torch then marks every fork bad.
- "forked after a CPU profiler session": the same, after the parent ran one CPU-only profiler
  session (it initializes the CUDA driver: on an H100 every child then failed with
  "initialization error"; why `prewarm.prewarm_host` runs no profiler).

Usage: python benchmarks/probe_worker_start.py [--ns 1,8,16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def spawned(n: int, device: str) -> list[dict[str, float]]:
    from cudagym.sandbox.config import LocalSandboxConfig
    from cudagym.sandbox.local import LocalSandbox

    sb = LocalSandbox(LocalSandboxConfig(spare_workers=n, freeze_starting_spares=False))
    try:
        sb.warm(device)

        async def wait_all() -> list[dict[str, float]]:
            workers = list(sb._spares[device])
            await asyncio.gather(*(asyncio.shield(w.frames.ready) for w in workers))
            return [dict(w.frames.startup_s) for w in workers]

        return sb._loop_thread.call(wait_all(), timeout=600)
    finally:
        sb.close()


def _child(fd: int, t_fork: float, shm_mb: int) -> None:
    """In a forked child: the CUDA half of a worker's start-up, timed, then one checked kernel."""
    steps: dict[str, float] = {"fork": time.perf_counter() - t_fork}
    t = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        steps[name], t = now - t, now

    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        from cudagym.sandbox.timing import gate_kernels
        from cudagym.sandbox.worker.prewarm import premap_results
        from cudagym.sandbox.worker.telemetry import DeviceTelemetry
        from cudagym.sandbox.worker.wire import result_memory

        if torch.cuda._is_in_bad_fork():
            raise RuntimeError("torch marked this fork bad (the parent touched the CUDA driver)")
        torch.empty(1, device="cuda")
        step("cuda_context")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.ones(2, device="cuda") + 1
        prof.events()
        step("cupti_session")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.ones(2, device="cuda") + 1
        prof.events()
        step("cupti_session_2")
        gate_kernels(torch.cuda.current_device())
        step("gate_kernels")
        DeviceTelemetry().handle()
        step("nvml")
        if shm_mb:
            premap_results(result_memory(shm_mb << 20), shm_mb)
            step("premap")
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        ok = bool(((x * 2).sum() == (1 << 20) * ((1 << 20) - 1)).item())
        step("first_kernel")
        steps["ok"] = float(ok)
        steps["wall"] = time.perf_counter() - t_fork
    except BaseException as e:  # noqa: BLE001
        steps["error"] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    os.write(fd, (json.dumps(steps) + "\n").encode())
    os._exit(0)


def forked(n: int, shm_mb: int) -> list[dict[str, Any]]:
    r, w = os.pipe()
    t_fork = time.perf_counter()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(w, t_fork, shm_mb)
        pids.append(pid)
    os.close(w)
    for pid in pids:
        os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return [json.loads(line) for line in f if line.strip()]


def zygote_prep() -> dict[str, float]:
    """The parent's side of the fork experiment: imports and the CPU prewarm, timed."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    import torch

    out["import_torch"] = time.perf_counter() - t
    t = time.perf_counter()
    from cudagym.sandbox.worker import jobs  # noqa: F401 - every harness module
    from cudagym.sandbox.worker.integrity import OpRecorder, live_helpers

    out["import_harness"] = time.perf_counter() - t
    t = time.perf_counter()
    with OpRecorder():
        torch.ones(2) + 1
    live_helpers()
    out["prewarm_cpu"] = time.perf_counter() - t
    out["cuda_initialized"] = float(torch.cuda.is_initialized())
    return out


def zygote_profile() -> float:
    """The profiler's first CPU-only session, in the parent (the second fork variant)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(2) + 1
    prof.events()
    return time.perf_counter() - t


def summarize(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and k != "ok"})
    return {k: (statistics.median(xs), max(xs)) for k in keys if (xs := [r[k] for r in rows if k in r])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,8,16", help="workers started at once, per row (default 1,8,16)")
    ap.add_argument("--premap-mb", type=int, default=512)
    ap.add_argument("--skip-spawned", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",") if x]
    os.environ.setdefault("CUDAGYM_DEVICE", "cuda")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() must not touch the driver
    report: dict[str, Any] = {"spawned": {}, "forked": {}, "forked after a CPU profiler session": {}}
    for n in ([] if args.skip_spawned else ns):
        print(f"[spawned] {n} at once", file=sys.stderr, flush=True)
        report["spawned"][n] = spawned(n, "cuda:0")
    report["zygote"] = zygote_prep()
    for n in ns:
        print(f"[forked] {n} at once", file=sys.stderr, flush=True)
        report["forked"][n] = forked(n, args.premap_mb)
    report["zygote"]["cpu_profile"] = zygote_profile()
    for n in ns:
        print(f"[forked after a CPU profiler session] {n} at once", file=sys.stderr, flush=True)
        report["forked after a CPU profiler session"][n] = forked(n, args.premap_mb)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    console = Console(width=240)
    console.print(f"zygote (parent, once): {report['zygote']}")
    for kind in ("spawned", "forked", "forked after a CPU profiler session"):
        for n, rows in report[kind].items():
            errors = [r["error"] for r in rows if "error" in r]
            t = Table(title=f"{kind}, {n} at once: p50 / max s" + (f"; ERRORS: {errors[:2]}" if errors else ""))
            s = summarize(rows)
            for k in s:
                t.add_column(k)
            t.add_row(*(f"{a:.2f} / {b:.2f}" for a, b in s.values()))
            console.print(t)


if __name__ == "__main__":
    main()
