"""The timing protocol, run inside a worker.

Before every call (timed or warm-up, indistinguishable to the callee), the call's input buffers
are refilled with fresh random values: same pointers, new contents, so neither pointer- nor
content-keyed result caches can replay.

CUDA (traced, the default). Per call:
1. synchronize the device: the GPU is idle;
2. on the timer's private stream, reset persisting L2 lines and flush the L2 cache by reading a
   buffer twice its size (a read leaves clean lines: the call pays for no write-backs of the
   flush), then keep the GPU busy for a short launch window (a sleep kernel,
   `TimingConfig.launch_window_us`); the caller's stream waits for both;
3. call. The call is launched while the flush and the window run, so the latency of getting
   its first launch to the GPU is hidden (as in Triton's `do_bench`, where the flush alone
   does it): it varies from process to process by tens of microseconds;
4. the timer's stream waits for the caller's stream, then a 4-byte marker runs on it. The
   marker is issued after the call returned on the host, so host-side work is never hidden;
5. synchronize the device, then run an end-of-call separator on the timer's stream, which the
   caller's stream waits for (so the harness's own work between calls is after the separator).

The CUDA profiler (CUPTI, through torch's Kineto) records every GPU activity on every stream:
kernels, copies, memsets. A call owns the activities that start between its flush and its
separator on streams other than the timer's. Its time runs:
- from the end of the launch window plus the harness's start latency, or from the earliest
  start of its own activities if that is earlier (work started on a side stream that does not
  wait for the caller's stream is counted from its start);
- to the latest of the marker's start less the harness's end latency, and the end of its own
  activities on any stream.

Work on side streams is therefore inside the interval, and so is host-side work: before the
first launch, beyond the launch window, the GPU waits; after it, the marker waits. The
device-wide synchronize that separates calls is not: its wake-up latency varies from process to
process.

The harness's latencies are the delays its own stream hand-overs add: from the window's end to
the start of a kernel that waited for it on the caller's stream, and from a kernel's end to the
start of the marker that waited for it. Each is the least delay seen over calls of one tiny
kernel, measured once per process before any candidate code is loaded, and at most
`MAX_LATENCY_NS` (1.1 us and 1.25 us on an H200). They are the harness's cost, not the call's;
left in, they pulled honest speedups of short kernels towards 1.

A known bias: CUPTI instruments kernels to trace them on every stream, which slows kernels of
many short-lived blocks (one element per thread over 16M elements: 9-12% on an H200), and not
torch's, cuBLAS's or Triton's kernels (`benchmarks/probe_ncu_gap.py`). See the README.

The timer's stream must carry exactly the timer's operations. If it does not, the trace is
rejected (`TimingTraceError`): something else used the stream, or the profiler was disturbed.

CUDA without the profiler (under Nsight Compute, which owns CUPTI): events around each call, with
a device-wide synchronize before the end event.

CPU: the wall clock around the call, after reading a buffer larger than the LLC.

Per-call times are in milliseconds. Statistics are computed by the parent (`TimingStats`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from cudagym.sandbox.protocol import TimingConfig

# Part of the baseline cache's key: a change to how calls are timed must not reuse old baselines
PROTOCOL_VERSION = "traced-2"

# The most the harness's latencies (start, end) may be, in ns: a measurement above it is capped
MAX_LATENCY_NS = 5_000
LATENCY_CALLS = 30  # calls of a tiny kernel that measure them

# GPU activity kinds that carry work (Kineto's names); runtime calls and sync records do not
_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


class TimingTraceError(RuntimeError):
    """The profiler's record of the timed calls is not the one the timer produced."""


def _cudart() -> Any | None:
    import glob

    roots = [os.path.dirname(torch.__file__)]
    try:
        import nvidia  # type: ignore[import-not-found]

        roots += list(nvidia.__path__)
    except ImportError:
        pass
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def profiler_available() -> bool:
    """Whether this process may use the CUDA profiler (not under Nsight Compute, which owns it)."""
    return not os.environ.get("CUDAGYM_UNDER_NCU")


class DeviceTimer:
    """Times calls on `device` (cuda:N or cpu) under the protocol above.

    Use: `start()`, then `call(fn, args)` per timed call, then `finish()` for the per-call times.
    Calls made outside `start()`/`finish()` (warm-up) go through the same steps and are not
    recorded. `kernel_ms` holds, after `finish()`, each timed call's GPU busy time (the summed
    duration of its activities; a diagnostic, traced mode only).
    """

    def __init__(self, device: torch.device, flush_l2: bool = True, traced: bool | None = None,
                 launch_window_us: float = 200.0, latency_ns: tuple[int, int] | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.traced = self.cuda and (profiler_available() if traced is None else traced)
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self._perf = time.perf_counter
        self._times: list[float] = []
        self._session: Any = None
        self._recording = False
        self._calls = 0
        self.kernel_ms: list[float] = []
        self.spans: list[CallSpan] = []
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
            flush_bytes = max(2 * l2, 64 * 2**20)
            self._cudart = _cudart()
            self._stream = torch.cuda.Stream(device) if self.traced else None
            self._marker = torch.empty(1, dtype=torch.int32, device=device)
            self._window_cycles = _sleep_cycles(launch_window_us) if self.traced and launch_window_us > 0 else 0
            if latency_ns is None:
                latency_ns = harness_latency_ns() if self.traced else (0, 0)
        else:
            flush_bytes = 64 * 2**20
            self._cudart = None
        self.latency_ns = tuple(min(max(int(v), 0), MAX_LATENCY_NS) for v in (latency_ns or (0, 0)))
        self._flush_buf = torch.zeros(flush_bytes // 4, dtype=torch.int32, device=device) if flush_l2 else None
        self._flush_sink = torch.empty(flush_bytes // 4096, dtype=torch.int32, device=device) if flush_l2 else None

    def flush(self) -> None:
        if self._cudart is not None:
            self._cudart.cudaCtxResetPersistingL2Cache()
        if self._flush_buf is not None:  # read, not written: the lines left in the cache are clean
            torch.sum(self._flush_buf.view(-1, 1024), dim=1, out=self._flush_sink)

    @property
    def _ops_per_call(self) -> int:
        """Operations on the timer's stream per traced call: flush, window, marker, separator."""
        return (self._flush_buf is not None) + 1 + 2

    def _before_call(self) -> None:
        self.flush()
        if self._window_cycles:
            torch.cuda._sleep(self._window_cycles)
        else:
            self._marker.zero_()  # the step's end is still one operation on the timer's stream

    def _on_timer_stream(self, op: Callable[[], None], caller: Any) -> None:
        """Issue `op` on the timer's stream, then make `caller` current again."""
        torch.cuda.set_stream(self._stream)
        op()
        torch.cuda.set_stream(caller)

    # -- the timed session ------------------------------------------------------------------
    def start(self) -> None:
        """Begin recording timed calls."""
        self._times, self.kernel_ms, self._calls = [], [], 0
        if self.traced:
            from torch.autograd.profiler import profile

            self._sync()
            self._session = profile(use_cpu=False, use_device="cuda", use_kineto=True)
            self._session.__enter__()
            self._separator(torch.cuda.current_stream(self.device))  # names the timer's stream in the trace
        self._recording = True

    def call(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """One call under the protocol; returns its output."""
        if self.traced:
            caller = torch.cuda.current_stream(self.device)
            self._sync()
            self._on_timer_stream(self._before_call, caller)
            caller.wait_stream(self._stream)
            out = fn(*args)
            self._stream.wait_stream(caller)
            self._on_timer_stream(self._marker.zero_, caller)
            self._sync()
            self._separator(caller)
            self._calls += self._recording
            return out
        self.flush()
        self._sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            self._sync()
            end.record()
            end.synchronize()
            ms = float(start.elapsed_time(end))
        else:
            t0 = self._perf()
            out = fn(*args)
            ms = (self._perf() - t0) * 1e3
        if self._recording:
            self._times.append(ms)
        return out

    def _separator(self, caller: Any) -> None:
        self._on_timer_stream(self._marker.zero_, caller)
        caller.wait_stream(self._stream)

    def finish(self) -> list[float]:
        """Stop recording; the per-call times in milliseconds."""
        self._recording = False
        if not self.traced:
            return self._times
        self._sync()
        session, self._session = self._session, None
        try:
            session.__exit__(None, None, None)
        except RuntimeError as e:  # stopped already, by someone else
            raise TimingTraceError(f"the profiler could not be stopped: {e}") from None
        result = session.kineto_results
        if type(result) is not torch._C._autograd._ProfilerResult:
            raise TimingTraceError("the profiler's result is not torch's own")
        self.spans = read_trace(result.events(), self._calls, self._ops_per_call)
        self._times, self.kernel_ms = per_call_ms(self.spans, self.latency_ns)
        return self._times


def _is_gpu_work(e: Any) -> bool:
    if e.device_type() != torch.autograd.DeviceType.CUDA:
        return False
    if hasattr(e, "activity_type"):  # torch >= 2.12 names the record's kind
        return e.activity_type() in _WORK
    return not e.is_user_annotation() if hasattr(e, "is_user_annotation") else True


@functools.cache
def _sleep_cycles(us: float) -> int:
    """GPU clock cycles of a sleep kernel that lasts about `us` microseconds (measured once per
    process: a spare measures it while idle)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first run loads the kernel
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    return max(1, int(probe * us / 1e3 / max(start.elapsed_time(end), 1e-6)))


class CallSpan(NamedTuple):
    """One traced call's landmarks (ns on the GPU's clock)."""

    ready: int  # the launch window's end: the call's own work may start from here
    first: int | None  # the start of its earliest own activity (None: it ran none)
    last: int | None  # the end of its latest own activity
    marker: int  # the start of the end marker (issued after the call returned on the host)
    busy: int  # the summed duration of its activities

    def interval_ms(self, latency_ns: tuple[int, int] = (0, 0)) -> float:
        """The call's time, less the harness's own start and end latencies."""
        t0, t1 = self.ready + latency_ns[0], self.marker - latency_ns[1]
        if self.first is not None:
            t0, t1 = min(t0, self.first), max(t1, self.last or t1)
        return max(t1 - t0, 0) / 1e6


def read_trace(events: Sequence[Any], calls: int, per_call: int = 3) -> list[CallSpan]:
    """The landmarks of `calls` timed calls in a trace.

    The first GPU activity of the trace is the separator that names the timer's stream; that
    stream then holds, for each call, `per_call` operations in order: those before the call
    (flush, launch window), the marker, the separator.
    """
    acts = sorted(((e.device_resource_id(), e.start_ns(), e.end_ns()) for e in events if _is_gpu_work(e)),
                  key=lambda a: a[1])
    if not acts:
        raise TimingTraceError("the profiler recorded no GPU activity")
    timer_stream = acts[0][0]
    own = [a for a in acts if a[0] == timer_stream]
    others = [a for a in acts if a[0] != timer_stream]
    if len(own) != 1 + per_call * calls:
        raise TimingTraceError(f"the timer's stream ran {len(own)} operations where the timer issued "
                               f"{1 + per_call * calls}")
    spans = []
    j = 0
    for i in range(calls):
        ops = own[1 + per_call * i: 1 + per_call * (i + 1)]
        first, ready, marker, sep = ops[0], ops[-3], ops[-2], ops[-1]
        while j < len(others) and others[j][1] < first[1]:
            j += 1  # the harness's own work between calls (input refill, kept outputs)
        t0 = t1 = None
        work = 0
        while j < len(others) and others[j][1] < sep[1]:
            _, s, e = others[j]
            t0, t1, work = s if t0 is None else min(t0, s), e if t1 is None else max(t1, e), work + (e - s)
            j += 1
        spans.append(CallSpan(ready[2], t0, t1, marker[1], work))
    return spans


def per_call_ms(spans: Sequence[CallSpan], latency_ns: tuple[int, int] = (0, 0)) -> tuple[list[float], list[float]]:
    """Per-call times and GPU busy times (ms) of traced calls."""
    return [c.interval_ms(latency_ns) for c in spans], [c.busy / 1e6 for c in spans]


def attribute(events: Sequence[Any], calls: int, per_call: int = 3,
              latency_ns: tuple[int, int] = (0, 0)) -> tuple[list[float], list[float]]:
    """Per-call times and GPU busy times (ms) from a trace of `calls` timed calls."""
    return per_call_ms(read_trace(events, calls, per_call), latency_ns)


@functools.cache
def harness_latency_ns() -> tuple[int, int]:
    """The harness's start and end latencies on this process's GPU (see the module's text):
    the least delays seen over `LATENCY_CALLS` traced calls of a 4-byte fill kernel (a timer
    caps them at `MAX_LATENCY_NS`). Measured once per process; a worker does it before loading
    any candidate code (`harness.prewarm`)."""
    timer = DeviceTimer(torch.device("cuda"), flush_l2=False, traced=True, latency_ns=(0, 0))
    probe = torch.empty(1, dtype=torch.int32, device="cuda")
    timer.start()
    for _ in range(LATENCY_CALLS):
        timer.call(probe.zero_, [])
    timer.finish()
    spans = [c for c in timer.spans if c.first is not None and c.last is not None]
    if not spans:
        return (0, 0)
    return (min(c.first - c.ready for c in spans), min(c.marker - c.last for c in spans))  # type: ignore[operator]


def refill_(buffers: Sequence[Any], fresh: Sequence[Any]) -> None:
    """Copy fresh values into existing input buffers (tensors in place; other args unchanged)."""
    for b, f in zip(buffers, fresh):
        if isinstance(b, torch.Tensor) and isinstance(f, torch.Tensor):
            b.copy_(f)


def run_timed_loop(
    fn: Callable[..., Any],
    input_sets: list[list[Any]],
    fresh_inputs: Callable[[], list[Any]],
    timer: DeviceTimer,
    cfg: TimingConfig,
    keep: Callable[[int, int, list[Any], Any], None] | None = None,
) -> list[float]:
    """Warm up, then time a number of calls fixed from the warm-up; returns times in ms.

    Warm-up lasts `cfg.warmup_calls` calls and at least `cfg.warmup_ms` of wall-clock time (so
    clocks leave their idle state however short the call). The number of timed calls is then
    `cfg.target_ms` over the warm-up's median wall time per call, within
    [`cfg.min_calls`, `cfg.max_calls`]. It is fixed before the first timed call, so outputs to
    re-check can be drawn from all of them. The garbage collector is paused so that a
    collection does not land inside a timed call. `keep(i, n, inputs, out)` is called after
    timed call i of n (outside the timed interval).
    """
    k = len(input_sets)
    clock = timer._perf
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        t0, i, walls = clock(), 0, []
        while i < cfg.warmup_calls or ((clock() - t0) * 1e3 < cfg.warmup_ms and i < cfg.max_calls):
            refill_(input_sets[i % k], fresh_inputs())
            t = clock()
            timer.call(fn, input_sets[i % k])
            walls.append(clock() - t)
            i += 1
        per_call_ms = statistics.median(walls[len(walls) // 2:]) * 1e3
        n = max(cfg.min_calls, min(cfg.max_calls, math.ceil(cfg.target_ms / max(per_call_ms, 1e-6))))
        timer.start()
        for i in range(n):
            args = input_sets[i % k]
            refill_(args, fresh_inputs())
            out = timer.call(fn, args)
            if keep is not None:
                keep(i, n, args, out)
            del out
        return timer.finish()
    finally:
        if gc_was_enabled:
            gc.enable()
