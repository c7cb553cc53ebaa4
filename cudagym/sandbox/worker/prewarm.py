"""A worker's start-up before its job, in two halves: `prewarm_host` (no GPU driver: a fork
server runs it once for all its workers) makes the `WorkerState`, and `prewarm_device` (in the
worker itself) does the rest; `premap_results` maps the result memory while the worker waits.

Everything the integrity checks compare with is taken here, before any candidate code runs.
"""

from __future__ import annotations

import mmap
import gc
import os
import sys
import types
from pathlib import Path

import torch

from cudagym.sandbox import timing
from cudagym.sandbox.opwatch import OpWatch
from cudagym.sandbox.origin import KernelWatch
from cudagym.sandbox.worker import integrity
from cudagym.sandbox.worker.failures import CandidateError
from cudagym.sandbox.worker.integrity import InputKernels, OpRecorder, live_helpers, snapshot_originals
from cudagym.sandbox.worker.jobs import HARNESS_MODULES
from cudagym.sandbox.worker.problem import Problem
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.telemetry import DeviceTelemetry, Phases
from cudagym.sandbox.worker.wire import Channel, LineReader, map_shared

# the classes whose methods the integrity snapshot covers
HARNESS_CLASSES = (Channel, LineReader, OpRecorder, InputKernels, Problem, CandidateError, Phases, DeviceTelemetry,
                   WorkerState, timing.DeviceTimer, OpWatch, KernelWatch)


def profiler_available() -> bool:
    """Whether this process may use the CUDA profiler (not under Nsight Compute, which owns it)."""
    return not os.environ.get("CUDAGYM_UNDER_NCU")


def _timer_modules() -> list[types.ModuleType]:
    """The modules of the timer's code that the harness calls (their own functions are snapshot too)."""
    used = (timing.DeviceTimer, timing.Evidence, timing.TimerTamperedError, timing.drive_calls, timing.foreign_hooks,
            timing.gate_kernels, timing.harness_calibration, timing.projection, timing.use_native_close)
    return list(dict.fromkeys(sys.modules[o.__module__] for o in used))


def prewarm_host() -> WorkerState:
    """The part of the prewarm that touches no GPU driver, so a fork server can run it once
    for all its workers: the worker's state with the identity snapshot of the harness's code,
    the profiler's pause switches made inert, psutil, dynamo (via the dispatch mode), the op
    counter, the audit hook, and the identity snapshot of the watched functions.

    Not the profiler (`prewarm_device`): its first session, even a CPU-only one, initializes the
    CUDA driver, and the driver cannot be used in a process forked after that. Not inductor:
    importing it fixes its cache paths (under /tmp) before a baseline job points them into its
    scratch directory, the only place the job may write, and every torch.compile then failed
    with a PermissionError (`tests/test_compile_baseline.py`); it would also add about 1.5 s to
    every worker's start for the baseline jobs' sake, which are cached."""
    import psutil  # noqa: F401
    from torch.profiler import ProfilerActivity, profile  # noqa: F401
    from torch.utils.flop_counter import FlopCounterMode  # noqa: F401

    modules = (*HARNESS_MODULES, sys.modules[__name__])
    state = WorkerState(snapshot=integrity.take_snapshot(modules, _timer_modules(), HARNESS_CLASSES))
    integrity.install_inert_switches(state)
    state.originals.update(integrity.watched_now())
    state.c_entries = integrity.c_entries(list(state.originals.values()))  # the built-ins' C functions, now
    state.clock_slots = integrity.clock_slots(list(state.originals.values()))  # and the clock slots they call through
    with OpRecorder():
        torch.ones(2) + 1
    live_helpers()
    watch = OpWatch.load(Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home()))
    state.opwatch = watch
    state.opwatch_changes = watch.lib.opwatch_state_changes  # bound before any candidate code
    state.opwatch_callbacks = watch.lib.opwatch_callbacks_registered
    timing.use_native_close(watch.cpu_close, watch.cpu_open)  # the CPU timers' close and open: the harness's own
    try:  # filelock (inductor's and Triton's caches) adds an audit hook of its own when first imported
        import filelock  # noqa: F401  (on Python >= 3.12): before the refusal, not at a candidate's compile
    except ImportError:
        pass
    sys.addaudithook(integrity.audit_hook(state))  # once per process: a later one is refused
    snapshot_originals(state)
    # the globals the timed loop reads between a call and its report, checked at each call's request
    state.globals_changed = integrity.globals_check(dict.fromkeys(
        [*modules, *_timer_modules(), sys.modules[OpWatch.__module__], sys.modules[KernelWatch.__module__]]))
    freeze_heap()
    return state


def freeze_heap() -> None:
    """Move every object the harness made so far out of the garbage collector's reach (`gc.freeze`):
    the full collection a timed loop starts with (`cudagym.sandbox.timing.drive_calls`) then scans
    only what the job made since, not torch's and the harness's ~300,000 objects (0.14 s, inside
    the job's time alone on the GPU). A fork server's workers share the frozen pages unwritten."""
    gc.freeze()


def prewarm_device(state: WorkerState) -> None:
    """The rest of the prewarm, in the worker itself: the profiler's first session (over a
    second on its own; on a GPU, CUPTI's too), the timer's gate kernels (NVRTC) and NVML."""
    from torch.profiler import ProfilerActivity, profile

    if profiler_available() and os.environ.get("CUDAGYM_DEVICE") == "cuda":
        load_kernel_watch(state)  # before the profiler's first session, which would take CUPTI
    if profiler_available():  # not under Nsight Compute, which owns CUPTI in this process
        cuda = os.environ.get("CUDAGYM_DEVICE") == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with OpRecorder(), profile(activities=activities) as prof:
            torch.ones(2, device="cuda" if cuda else "cpu") + 1
        prof.events()
        if cuda:  # the timer's gate kernels; its overhead is measured by each timing job
            timing.gate_kernels(torch.cuda.current_device())
    if os.environ.get("CUDAGYM_DEVICE") == "cuda":
        state.telemetry.handle()
    freeze_heap()
    snapshot_originals(state)


def load_kernel_watch(state: WorkerState) -> None:
    """Install the kernel watcher (`cudagym.sandbox.origin`, built by the parent beside the op
    counter) before the profiler's first session takes CUPTI; why not, if it cannot be."""
    try:
        state.kwatch = KernelWatch.load(Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home()))
    except Exception as e:  # noqa: BLE001 - reported with every verify: the GPU audit cannot pass without it
        state.kwatch_error = f"{type(e).__name__}: {e}"[:500]
        return
    # the probe after the watcher, never before: the module of torch's fill kernels would load
    # unwatched, and every later launch from it would have no origin ("<unknown library>")
    try:
        state.kprobe = torch.zeros(1, device="cuda")
    except Exception as e:  # noqa: BLE001 - e.g. the GPU's memory full while this spare started
        state.kwatch = None  # a watcher without its probe would read as one the candidate disabled
        state.kwatch_error = f"the kernel watcher's probe could not be allocated: {type(e).__name__}: {e}"[:500]


def premap_results(shm_fd: int, mb: int) -> mmap.mmap | None:
    """Map, populate and (on a GPU) page-lock the first `mb` MB of the result memory while idle:
    outputs then go from the device into it at full copy speed, with no page faults. The mapping
    (None for none), for the job's `Channel`."""
    size = min(mb << 20, os.fstat(shm_fd).st_size)
    if size <= 0:
        return None
    mm = map_shared(shm_fd, size)
    if torch.cuda.is_initialized():
        import ctypes

        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        torch.cuda.cudart().cudaHostRegister(addr, size, 0)  # best effort: pageable copies otherwise
    return mm
