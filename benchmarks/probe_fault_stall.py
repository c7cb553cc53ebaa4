"""Where the time goes when a candidate's kernel spins forever (GPU), and what is left after.

Runs one `verify` of a candidate whose kernel never ends, in this process's `Evaluator`, with
a short job timeout, and logs (seconds since the check started):
- the sandbox's steps, as the wrapped methods of `LocalSandbox` see them (a worker asked for
  and ready, a job dispatched and over, a kill, a reap, a lease released);
- once a second: each process of ours (cmdline with "cudagym"), its state (R/S/D/Z), its
  kernel wait channel and, in D state, its kernel stack; NVML's compute processes and
  utilization of the GPU.
It keeps watching after the verdict (until the GPU holds no process of ours, or --after s).

Usage: python benchmarks/probe_fault_stall.py [--timeout 30] [--after 60] [--spawn] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

SPIN_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void spin(volatile int* flag) { while (flag[0] == 0) {} }
extern "C" int launch(int* flag, void* s) {
    spin<<<1024, 256, 0, (cudaStream_t)s>>>(flag);
    return (int)cudaGetLastError();
}
"""
SPIN_PY = """
import ctypes, torch, torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(features))

    def forward(self, x):
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        _lib.launch(ptr(flag), stream())
        torch.cuda.synchronize()
        return x
"""

T0 = time.perf_counter()
LOG: list[dict] = []


def log(what: str, **kw) -> None:
    rec = {"t": round(time.perf_counter() - T0, 3), "what": what, **kw}
    LOG.append(rec)
    print(json.dumps(rec), flush=True)


def ours() -> list[dict]:
    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "cudagym" not in cmd or p.pid == os.getpid():
            continue
        rec = {"pid": p.pid, "ppid": p.info["ppid"], "status": p.info["status"], "cmd": cmd[-60:]}
        try:
            rec["wchan"] = Path(f"/proc/{p.pid}/wchan").read_text()
            if p.info["status"] == psutil.STATUS_DISK_SLEEP:
                rec["stack"] = Path(f"/proc/{p.pid}/stack").read_text()[-600:]
        except OSError:
            pass
        out.append(rec)
    return out


def gpu() -> dict:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = [(p.pid, (p.usedGpuMemory or 0) >> 20) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        return {"procs": procs, "util": pynvml.nvmlDeviceGetUtilizationRates(h).gpu}
    finally:
        pynvml.nvmlShutdown()


def watch(stop: threading.Event) -> None:
    while not stop.is_set():
        log("sample", gpu=gpu(), procs=ours())
        stop.wait(1.0)


def wrap(cls: type, name: str) -> None:
    import asyncio

    orig = getattr(cls, name)
    if asyncio.iscoroutinefunction(orig):
        async def w(self: Any, *a: Any, **k: Any) -> Any:
            log(f"{name} start")
            try:
                return await orig(self, *a, **k)
            finally:
                log(f"{name} end")
    else:
        def w(self: Any, *a: Any, **k: Any) -> Any:
            log(name)
            return orig(self, *a, **k)
    setattr(cls, name, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=60.0)
    ap.add_argument("--spawn", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import tempfile

    from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
    from cudagym.sandbox.local import LocalSandbox
    from cudagym.sandbox.protocol import LimitsConfig
    from cudagym.sandbox.workspace import Workspace
    from cudagym.tasks.loaders import bundled_task

    for name in ("_ready", "_run_on", "_reap", "_kill", "_spawn", "_stop_spares"):
        wrap(LocalSandbox, name)
    stop = threading.Event()
    threading.Thread(target=watch, args=(stop,), daemon=True).start()
    tmp = Path(tempfile.mkdtemp())
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp / "cache", compile_baseline=False,
                          limits=LimitsConfig(timeout_s=args.timeout))
    ev = Evaluator(cfg)
    if args.spawn:
        ev.sandbox.config.fork_server = False
    task = bundled_task("ew_scale_bias_gelu").for_target(ev.target)
    ws = Workspace.from_solution(tmp / "ws", task, Path(__file__).resolve().parent.parent / "examples" / "solutions"
                                 / "ew_scale_bias_gelu" / "cuda")
    ws.write("model_new.py", SPIN_PY)
    for p in (ws.root / "kernels").glob("*"):
        p.unlink()
    ws.write("kernels/spin.cu", SPIN_CU)
    log("verify start")
    v = ev.verify(task, ws)
    log("verify end", error_kind=str(v.error_kind), error=(v.error or "")[:300], breakdown=v.breakdown)
    t_end = time.perf_counter()
    while time.perf_counter() - t_end < args.after:
        g = gpu()
        if not g["procs"] and g["util"] == 0 and time.perf_counter() - t_end > 5:
            break
        time.sleep(1.0)
    log("close start")
    ev.close()
    log("close end")
    time.sleep(2)
    stop.set()
    log("final", gpu=gpu(), procs=ours())
    if args.out:
        args.out.write_text(json.dumps(LOG, indent=1))


if __name__ == "__main__":
    main()
