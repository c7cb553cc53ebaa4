"""GPUs of this host, seen through NVML (no CUDA context in the evaluator's process)."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from typing import Any


def _visible(count: int) -> list[int]:
    """NVML indices of the GPUs this process may use, in CUDA order (CUDA_VISIBLE_DEVICES)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return list(range(count))
    return [i for i in (int(x) for x in vis.split(",") if x.strip().isdigit()) if i < count]


def _nvml(query: Any) -> Any:
    """`query(pynvml, visible NVML indices)` inside an NVML session; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return query(pynvml, _visible(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no NVML: no GPU
        return None


@lru_cache(maxsize=1)
def gpu_names() -> tuple[str, ...]:
    """Names of the visible NVIDIA GPUs, honouring CUDA_VISIBLE_DEVICES; () without any."""
    names = _nvml(lambda nv, idx: [nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i)) for i in idx]) or []
    return tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)


def gpu_capabilities() -> tuple[tuple[int, int], ...]:
    """Compute capabilities (major, minor) of the visible NVIDIA GPUs, in CUDA order; () without any."""
    found = _nvml(lambda nv, idx: [tuple(nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(i)))
                                   for i in idx]) or []
    return tuple((int(c[0]), int(c[1])) for c in found)


@lru_cache(maxsize=None)
def gpu_local_cpus(index: int) -> tuple[int, ...]:
    """The CPUs nearest visible GPU `index` (its NUMA node, from NVML), within this process's
    affinity; () when unknown. Launch latency from a far socket is higher."""
    words = _nvml(lambda nv, idx: nv.nvmlDeviceGetCpuAffinity(
        nv.nvmlDeviceGetHandleByIndex(idx[index]), (os.cpu_count() or 64) // 64 + 1) if index < len(idx) else None)
    if words is None:
        return ()
    cpus = {64 * i + b for i, word in enumerate(words) for b in range(64) if (int(word) >> b) & 1}
    return tuple(sorted(cpus & os.sched_getaffinity(0)))


@lru_cache(maxsize=None)
def gpu_memory_bytes(index: int = 0) -> int | None:
    """Total memory of visible GPU `index` (NVML), in bytes; None without it."""
    total = _nvml(lambda nv, idx: int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(idx[index])).total)
                  if index < len(idx) else None)
    return int(total) if total else None


def gpu_count() -> int:
    return len(gpu_names())


@lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


# Peak figures for the roofline floor: memory bandwidth (bytes/s) and the highest dense
# tensor-core rate (FLOP/s), so that the floor is a true lower bound on time.
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (4.8e12, 9.9e14),
    "H100": (3.35e12, 9.9e14),
    "A100": (2.04e12, 3.12e14),
    "L40S": (8.64e11, 3.66e14),
    "A10": (6.0e11, 1.25e14),
    "L4": (3.0e11, 1.21e14),
    "B200": (8.0e12, 2.25e15),
}
_UNKNOWN_GPU = (1.0e13, 5.0e15)
_CPU = (1.0e12, 1.0e14)  # generous: no host gets near these


def peaks_for(device_name: str) -> tuple[float, float]:
    if device_name == "cpu" or not device_name:
        return _CPU
    for key, val in PEAKS.items():
        if key in device_name.upper():
            return val
    return _UNKNOWN_GPU


def foreign_gpu_use(index: int, ours: set[int], since_us: int = 0, allow: tuple[str, ...] = (),
                    idle_ok: frozenset[int] = frozenset()) -> str | None:
    """What processes other than `ours` do on visible GPU `index`, or None if nothing: compute or
    graphics processes on it now (NVML's process lists), and processes with SM utilization in
    NVML's per-process samples since `since_us` (its timestamps, µs of the wall clock; 0: the
    last samples) where the GPU keeps them. `idle_ok` may hold a context but not use the SMs
    (the evaluator's own process). `allow` names processes that count as ours (e.g.
    "nvidia-cuda-mps-server" where GPUs are shared through MPS on purpose). None too where NVML
    cannot tell (no driver)."""
    import psutil

    def query(nv: Any, idx: list[int]) -> list[tuple[int, int | None, int | None]]:
        if index >= len(idx):
            return []
        h = nv.nvmlDeviceGetHandleByIndex(idx[index])
        seen: dict[int, list[int | None]] = {}
        for get in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in get(h):
                    seen.setdefault(int(p.pid), [None, None])[0] = int(p.usedGpuMemory or 0) >> 20
            except nv.NVMLError:
                pass
        try:
            for sample in nv.nvmlDeviceGetProcessUtilization(h, since_us):
                if sample.smUtil and sample.timeStamp > since_us:
                    rec = seen.setdefault(int(sample.pid), [None, None])
                    rec[1] = max(rec[1] or 0, int(sample.smUtil))
        except nv.NVMLError:  # no samples since then, or not supported on this GPU
            pass
        return [(pid, mib, sm) for pid, (mib, sm) in seen.items()]

    found = _nvml(query)
    if not found:
        return None
    foreign = []
    for pid, mib, sm in found:
        if pid in ours or pid in idle_ok and not sm:
            continue
        try:
            proc = psutil.Process(pid)
            name, cmd = proc.name(), " ".join(proc.cmdline())[:100]
        except psutil.Error:
            name = cmd = "?"
        if name in allow:
            continue
        what = [cmd] + ([f"{mib} MiB"] if mib is not None else []) + ([f"SM {sm}%"] if sm is not None else [])
        foreign.append(f"pid {pid} ({', '.join(what)})")
    return "; ".join(foreign) or None
