"""Probe of the kernel watcher (`cudagym/sandbox/origin.py`) on a GPU: which origin each kind of
launch gets (an nvcc-built library's <<<>>> launch, torch ops, cuBLAS, a CUDA graph of torch ops,
a driver-API launch of a torch kernel), whether torch's profiler still works beside it, and what
a launch costs the host with the callbacks armed and not. Prints a report; asserts nothing."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CU = r"""
#include <cuda_runtime.h>
__global__ void own_scale(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.f; }
extern "C" int launch_own(float* x, int n, void* s) {
  own_scale<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, n);
  return (int)cudaGetLastError();
}
"""


def main() -> None:
    cache = Path(tempfile.mkdtemp())
    from cudagym.sandbox.origin import KernelWatch

    t0 = time.perf_counter()
    watch = KernelWatch.load(cache)
    print(f"installed in {time.perf_counter() - t0:.2f} s (build included)")
    import torch

    d = Path(tempfile.mkdtemp())
    (d / "k.cu").write_text(CU)
    subprocess.run(["nvcc", "-O3", "-arch=sm_90a", "-Xcompiler", "-fPIC", "-shared", str(d / "k.cu"), "-o",
                    str(d / "libk.so")], check=True)
    lib = ctypes.CDLL(str(d / "libk.so"))
    x = torch.ones(1 << 20, device="cuda")
    s = torch.cuda.current_stream().cuda_stream

    def show(title: str, fn: Callable[[], Any]) -> None:
        watch.reset()
        watch.arm()
        fn()
        watch.disarm()
        torch.cuda.synchronize()
        print(f"== {title}")
        for r in watch.records():
            origin = Path(r.origin).name if "/" in r.origin else r.origin
            print(f"   {r.via:6} {r.launches:4} {r.threads:>10} {origin:32} {r.name[:110]}")

    show("own <<<>>>", lambda: lib.launch_own(ctypes.c_void_p(x.data_ptr()), x.numel(), ctypes.c_void_p(s)))
    show("torch gelu, fill, copy", lambda: (torch.nn.functional.gelu(x), x.fill_(1.0), x.clone()))
    a = torch.randn(512, 512, device="cuda")
    show("torch matmul (cuBLAS)", lambda: a @ a)
    g = torch.cuda.CUDAGraph()
    y = torch.randn(4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        _graph_out = torch.nn.functional.gelu(y * 2 + 1)  # the captured output, kept alive with the graph
    show("graph replay of torch ops", g.replay)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        lib.launch_own(ctypes.c_void_p(x.data_ptr()), x.numel(),
                       ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    show("graph replay of own kernel", g2.replay)
    print("known:", watch.known()[:3000])
    # the profiler beside the watcher
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.nn.functional.gelu(x)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print("profiler CUDA events:", len(names), names[:3])
    except Exception as e:  # noqa: BLE001
        print("profiler failed:", type(e).__name__, e)
    show("after profiler: own + gelu",
         lambda: (lib.launch_own(ctypes.c_void_p(x.data_ptr()), x.numel(), ctypes.c_void_p(s)),
                  torch.nn.functional.gelu(x)))
    print("alive:", watch.check_alive(lambda: torch.zeros(1, device="cuda").fill_(1)))
    # host cost per launch: 20000 launches of the own kernel, armed vs disarmed vs (no callback) impossible here
    small = torch.ones(256, device="cuda")
    p = ctypes.c_void_p(small.data_ptr())
    for armed in (False, True, False, True):
        (watch.arm if armed else watch.disarm)()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20000):
            lib.launch_own(p, 256, ctypes.c_void_p(s))
        torch.cuda.synchronize()
        print(f"armed={armed}: {(time.perf_counter() - t) / 20000 * 1e6:.2f} us per launch (ctypes call included)")
    watch.disarm()
    gpu_time(lib, watch)


def gpu_time(lib: ctypes.CDLL, watch: Any = None) -> None:
    """GPU time per kernel of 200 back-to-back launches (events around the whole run): the
    callbacks run on the host, so the kernels' own time should not move."""
    import torch

    x = torch.ones(1 << 22, device="cuda")
    p, s = ctypes.c_void_p(x.data_ptr()), torch.cuda.current_stream().cuda_stream
    for armed in ((False, True) * 3 if watch else (False,) * 3):
        if watch:
            (watch.arm if armed else watch.disarm)()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(200):
            lib.launch_own(p, x.numel(), ctypes.c_void_p(s))
        b.record()
        torch.cuda.synchronize()
        label = "no watcher" if watch is None else f"armed={armed}"
        print(f"GPU {label}: {a.elapsed_time(b) / 200 * 1e3:.2f} us per kernel (4M-element scale)")
    if watch:
        watch.disarm()


def bare() -> None:
    """The same launches in a process without the watcher: the host cost it adds."""
    import torch

    d = Path(tempfile.mkdtemp())
    (d / "k.cu").write_text(CU)
    subprocess.run(["nvcc", "-O3", "-arch=sm_90a", "-Xcompiler", "-fPIC", "-shared", str(d / "k.cu"), "-o",
                    str(d / "libk.so")], check=True)
    lib = ctypes.CDLL(str(d / "libk.so"))
    small = torch.ones(256, device="cuda")
    p, s = ctypes.c_void_p(small.data_ptr()), torch.cuda.current_stream().cuda_stream
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20000):
            lib.launch_own(p, 256, ctypes.c_void_p(s))
        torch.cuda.synchronize()
        print(f"no watcher: {(time.perf_counter() - t) / 20000 * 1e6:.2f} us per launch (ctypes call included)")
    gpu_time(lib)


if __name__ == "__main__":
    bare() if sys.argv[1:] == ["bare"] else main()
