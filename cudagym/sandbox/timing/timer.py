"""The GPU and CPU timer of `cudagym.sandbox.timing` (`DeviceTimer`), its calibration, the loop of
calls the parent drives (`drive_calls`), and the functions a timed call runs (`projection`,
`touch_pages`, `foreign_hooks`). Every module-level function the timed path calls lives here: the
harness pins the functions of `DeviceTimer`'s module against rebinding by the candidate.
"""

from __future__ import annotations

import ctypes
import os
import functools
import gc
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cudagym.sandbox.protocol import (CALIBRATION_ELEMENTS, EVIDENCE_SAMPLES, TAIL_ALLOWANCE_MS, Calibration,
                                      call_ms_from)
from cudagym.sandbox.timing.evidence import CpuClose, Evidence, Reading
from cudagym.sandbox.timing.gate import (CLOSE_TIMEOUT_NS, GATE_THREADS, MAX_SAMPLED_DIMS, MAX_SAMPLED_OUTPUTS,
                                         PROJECTED_KINDS, Samples, cuda_driver, cudart, gate_kernels)


# Part of the baseline cache's key: a change to how calls are timed must not reuse old baselines
# 14: a CPU call's interval is stamped by the harness's native open and close, which send the stamps
# and the evidence on the channel themselves (the open's write is inside the interval);
# 13: the CPU target's cache flush is the harness's native code on threads it joins (no OpenMP
# pool left spinning into the call), its candidate's inputs made outside its process (`worker.maker`),
# the baselines' records say what the close may project (`close_elements`);
# 12: the CPU target's close (page reads, sample draw and reads) is one native call inside the interval;
# 11: the close projects every output (its read phase capped per byte), a CPU call's output pages
# are read inside its interval; 10: one stream, the close's read phase left out, the overhead of a call
# that launches nothing
# (9: a self-stamping probe, more input sets, placements rotated; 7: outputs sampled by the close
# kernel; 6: a 1 ms window)
PROTOCOL_VERSION = "gated-events-14"

CALIBRATION_CALLS = 100  # calls that launch nothing, which measure the harness's overhead
# then this many with a contiguous fp32 output of LARGE_CALIBRATION_ELEMENTS, and with a transposed
# one of STRIDED_CALIBRATION_ELEMENTS: the close's time per element projected (H100: 2.6 ps per
# contiguous fp32 element, 2 bytes or 4 alike: the hash and fp64 sums, not the reads, bound it)
LARGE_CALIBRATION_CALLS = 10
LARGE_CALIBRATION_ELEMENTS = 1 << 24
STRIDED_CALIBRATION_ELEMENTS = 1 << 22
# the CPU target's calibration (its close projects at ns, not ps, per element): calls, then the
# elements of the small, large and strided outputs, and the calls of each of the larger two
CPU_CALIBRATION = (30, 1 << 16, 1 << 21, 1 << 16, 3)
# Sizes of the allocation held across each GPU call in turn (`drive_calls`), so that what a call
# allocates (its output) lands at other addresses from one call to the next: a one-op call of a few
# microseconds reads 0.3-0.7 us more or less from one process to the next with its placement
# (H100, `benchmarks/probe_stamps.py`), and a job's median should not hang on one placement.
PLACEMENT_BYTES = (0, 2**18, 2**19, 3 * 2**18, 2**20, 3 * 2**19, 5 * 2**19, 2**22)
SAMPLE_SIZE = EVIDENCE_SAMPLES  # elements of each output of a call read at its end (`DeviceTimer.read_at_end`)
PROJECTIONS = 4  # secret +-1 projections of every output of a GPU call (`projection`)


_M32 = 0xFFFFFFFF
_PROJECTION_CHUNK = 1 << 22  # elements per step of `projection`


def _mul32(x: Any, c: int) -> Any:
    """x * c mod 2**32 for x in [0, 2**32) (ints or int64 tensors: no product passes 2**49)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Any) -> Any:
    """The close kernel's `mix32` (a 32-bit integer hash), on ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def projection(t: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """Output `index` of a call projected as the close kernel projects it (float64, on `t`'s
    device): `PROJECTIONS` sums over every real component x_i of `t` (row-major; a complex
    element's real then imaginary part) of w_ki * x_i, with w_ki = +1 or -1 from bit k of a hash
    of (`seed`, `index`, i); then sum |x_i| and sum x_i^2 over the finite components, and the
    number of components that are not finite (the parent's bound on honest differences,
    `cudagym.rewards.compare.projection_mismatch`, uses these three).

    Weights drawn after the call returned are independent of an honest kernel's rounding, so
    its projections differ from the reference's by a Rademacher sum of its per-element errors;
    an output not computed in full differs by a sum of unbounded ones."""
    x = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    x = x.reshape(-1)
    s0 = (seed & _M32) ^ _mix32(2 * index + 1)
    s1 = ((seed >> 32) & _M32) ^ _mix32(2 * index + 2)
    sums = torch.zeros(PROJECTIONS + 3, dtype=torch.float64, device=t.device)
    for lo in range(0, x.numel(), _PROJECTION_CHUNK):
        part = x[lo:lo + _PROJECTION_CHUNK].to(torch.float64)
        i = torch.arange(lo, lo + part.numel(), dtype=torch.int64, device=t.device)
        h = _mix32((i & _M32) ^ s0)
        if lo + part.numel() > 1 << 32:
            h = torch.where(i >> 32 != 0, _mix32(h ^ (i >> 32) ^ s1), h)
        for k in range(PROJECTIONS):
            sums[k] += torch.where((h >> k) & 1 == 1, -part, part).sum()
        finite = torch.isfinite(part)
        kept = torch.where(finite, part, 0.0)
        sums[PROJECTIONS] += kept.abs().sum()
        sums[PROJECTIONS + 1] += (kept * kept).sum()
        sums[PROJECTIONS + 2] += (~finite).sum()
    return sums


def reference_projection(t: torch.Tensor, seed: int, index: int, native: Any = None) -> torch.Tensor:
    """`projection`, of a CPU tensor by the harness's native `cudagym_cpu_project` (`native`,
    `OpWatch.cpu_project`) where given: the reference-only worker projects every re-checked call's
    output, and torch's steps over a 16M-element output took 2 s a call on two cores (native: the
    close's own pass). The same sums, in another order of addition."""
    kind = PROJECTED_KINDS.get(t.dtype, 0)
    if native is None or t.is_cuda or kind == 0:
        return projection(t, seed, index)
    c = t.detach().contiguous()
    out = torch.zeros(PROJECTIONS + 3, dtype=torch.float64)
    if native(c.data_ptr(), c.numel() * (2 if c.is_complex() else 1), kind, index, seed, out.data_ptr()) != 0:
        return projection(t, seed, index)
    return out


def touch_pages(out: Any) -> None:
    """Read every page of each CPU tensor in `out` (a tensor, or a list or tuple of them), with
    torch: the CPU close of a timer without the harness's native close (tools, tests; a worker's
    timer has it), inside the call's interval, so that an output whose pages are filled when
    first read (a fault handler, a lazy mapping) is filled, and timed, there. A contiguous
    tensor is read one byte per 4 KB; any other tensor, in full."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if type(t) is not torch.Tensor or t.is_cuda or t.is_sparse or t.numel() == 0 or t.device.type == "meta":
            continue
        if t.is_contiguous():
            raw = t.detach().reshape(-1).view(torch.uint8)
            _ = int(raw[::4096].sum()) + int(raw[-1])
        else:
            t.detach().abs().sum() if not t.is_complex() else torch.view_as_real(t.detach()).abs().sum()


# the harness's `cudagym_cpu_close` and `cudagym_cpu_open` (`use_native_close`), for CPU timers made after
_NATIVE_CLOSE: list[Any] = []


def use_native_close(fn: Any, open_fn: Any = None) -> None:
    """CPU timers made from now on close their calls with `fn` (the harness's own native
    `cudagym_cpu_close` from opwatch.cpp, through ctypes: `OpWatch.cpu_close`) and open them
    with `open_fn` (`OpWatch.cpu_open`; None: the interval starts on Python's clock)."""
    _NATIVE_CLOSE[:] = [fn, open_fn]


class TimerTamperedError(Exception):
    """Something the candidate set up would run between a call's close and its evidence's send."""


_MONITORING = getattr(sys, "monitoring", None)  # Python 3.12+'s, bound as the harness is imported
# and what reads the hooks, as bound then: red team 23 put functions of its own at `sys.getprofile`,
# which the check called after the per-call checks and which rewrote the pending report
_HOOK_READERS = (sys.getprofile, sys.gettrace)


def foreign_hooks() -> str:
    """The Python hooks that run code of someone else's at the harness's next Python call or
    line, on this thread or (`threading`) on threads started later: profile and trace functions,
    and (Python 3.12+) `sys.monitoring` callbacks of any tool. The harness sets none, so any is
    the candidate's (names joined; "" for none)."""
    if (sys.getprofile, sys.gettrace) != _HOOK_READERS:
        return "sys.getprofile or sys.gettrace replaced"
    found = [name for name, hook in (("sys.setprofile", _HOOK_READERS[0]()), ("sys.settrace", _HOOK_READERS[1]()),
                                     ("threading.setprofile", getattr(threading, "_profile_hook", None)),
                                     ("threading.settrace", getattr(threading, "_trace_hook", None)))
             if hook is not None]
    monitoring = _MONITORING
    if getattr(sys, "monitoring", None) is not monitoring:  # red team 22's rewrote the report from its `get_tool`
        found.append("sys.monitoring replaced")
    elif monitoring is not None:
        found += [f"sys.monitoring tool {i} ({monitoring.get_tool(i)})" for i in range(6) if monitoring.get_tool(i)]
    return ", ".join(found)


class DeviceTimer:
    """Times calls on `device` (cuda:N or cpu) under the protocol of `cudagym.sandbox.timing`.

    `call(fn, args)` makes one call and returns its output and its time in ms. `calibration`
    is left out of every CUDA call (None: `harness_calibration()`). `close_timeouts()` counts the
    calls so far whose close kernel gave up.
    """

    def __init__(self, device: torch.device, flush_l2: bool = True, launch_window_us: float = 1000.0,
                 calibration: Calibration | None = None, native_close: Any = None, native_flush: Any = None,
                 native_open: Any = None, native_channel: bool = False) -> None:
        self.device = device
        # the CPU close (`_close_cpu`): the harness's native one (a worker's timer always has it),
        # and the interval's native start (`cudagym_cpu_open`), which it needs
        self._native_close = (None if device.type == "cuda"
                              else native_close or (_NATIVE_CLOSE[0] if _NATIVE_CLOSE else None))
        if native_close is None and _NATIVE_CLOSE and native_open is None:
            native_open = _NATIVE_CLOSE[1]
        self._native_open = native_open if self._native_close is not None else None
        # whether the native open and close send each call's stamps and evidence themselves (a timing
        # job's worker, its channel at `opwatch.CHANNEL_FD`): `send` then sends only what they did not
        self.native_channel = native_channel and self._native_open is not None
        # and its cache flush (`flush`), on as many threads as the process may run on
        self._native_flush = None if device.type == "cuda" else native_flush
        self._flush_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.cuda = device.type == "cuda"
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self._perf = time.perf_counter
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
            flush_bytes = max(2 * l2, 64 * 2**20)
            self._cudart = cudart()
            gate = gate_kernels(device.index if device.index is not None else torch.cuda.current_device())
            self._open, self._close, self._blocks = gate.open, gate.close, gate.blocks
            self._grid, self._block = (gate.blocks, 1, 1), (GATE_THREADS, 1, 1)
            self.holds_every_sm = gate.holds_every_sm
            self._gate = torch.zeros(4, dtype=torch.int32, device=device)
            # the gate kernels' %globaltimer stamps of the last call (ns; see the source)
            self._stamps = torch.zeros(4, dtype=torch.int64, device=device)
            self._libcuda = cuda_driver()
            # bound once: the timer's callables are checked for rebinding after each loop
            self._launch, self._to_host = self._libcuda.cuLaunchKernel, self._libcuda.cuMemcpyDtoHAsync_v2
            self._window_ns = int(launch_window_us * 1e3)
            if calibration is None:
                calibration = harness_calibration()
        else:
            flush_bytes = 64 * 2**20
            self._cudart = None
        self.calibration = calibration or Calibration(0, 0)
        self.window_ms = launch_window_us / 1e3 if self.cuda else 0.0
        # the host's time from the open kernel's launch to the close kernel's (the CPU target: the
        # call's): past `window_ms`, the call's time holds host work (diagnostic, last call only)
        self.host_ms: float | None = None
        self._cpu_phase_ns = 0  # the CPU close's projection pass in the last call
        # the last call's raw measurements (`call_ms_from`'s arguments): its interval (ms), its
        # close's read phase (ns) and what the close projected (contiguous and other elements);
        # the parent applies the calibration to them (`cudagym.sandbox.feed.CallFeed`)
        self.last_raw: tuple[float, int, int, int] = (0.0, 0, 0, 0)
        self._flush_buf = torch.zeros(flush_bytes // 8, dtype=torch.int64, device=device) if flush_l2 else None
        # while `call`'s `after` runs: what the close kernel will read, and the tensors it reads
        self._reading: Reading | None = None

    def flush(self) -> None:
        """The CPU target's cache flush (on a GPU, the open gate kernel reads the buffer): the
        harness's native one where the timer has it (no pool's thread left spinning into the call)."""
        if self._flush_buf is None:
            return
        if self._native_flush is not None:
            self._native_flush(self._flush_buf.data_ptr(), self._flush_buf.numel(), self._flush_threads)
        else:
            torch.sum(self._flush_buf)

    def stages(self, arg: Any) -> bool:
        """Whether the open gate can give `arg` its values (a contiguous tensor on the GPU)."""
        return self.cuda and isinstance(arg, torch.Tensor) and arg.is_cuda and arg.is_contiguous() and arg.numel() > 0

    def copy_plan(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The open gate's copies (source, destination: tensors of the same size, see `stages`),
        for `call`'s `copies`; None for none."""
        rows = []
        for src, dst in pairs:
            if not (self.stages(src) and self.stages(dst)) or src.nbytes != dst.nbytes:
                raise ValueError("the open gate copies between contiguous GPU tensors of one size")
            rows += [src.data_ptr(), dst.data_ptr(), dst.nbytes]
        return torch.tensor(rows, dtype=torch.int64, device=self.device) if rows else None

    def call(self, fn: Callable[..., Any], args: Sequence[Any],
             after: Callable[[Any], object] | None = None, copies: torch.Tensor | None = None,
             refill: Callable[[], object] | None = None, send: Callable[[], object] | None = None,
             mark: Callable[[], object] | None = None, held: list[Any] | None = None) -> tuple[Any, float]:
        """One call under the protocol; returns its output and its time in ms. `after(out)` runs
        once the call has returned, to register its outputs with `read_at_end`, inside the
        interval on both targets (on a GPU: on the timer's stream, before the close kernel, which
        reads them; on the CPU: before the native close, which reads them; see `cudagym.sandbox.timing`).
        `copies` (`copy_plan`; GPU): what the open gate copies at the window's end, before the
        start event. `refill()` (CPU): gives the call's input buffers their values after the
        cache flush, right before the interval opens, as the open gate does on a GPU, so that
        no thread of the candidate's can work on them while the flush runs. `send()` (CPU):
        sends the evidence `after` registered, after the close and still inside the interval, so
        that whatever rewrites it before it leaves is timed. `mark()` (CPU): runs right before the
        interval opens (the start of the sandbox's CPU-sample window). CPU: raises `TimerTamperedError`
        after the interval if a Python hook that is not the harness's was active when the call
        returned. `held` (`drive_calls`'): this call's own objects go there as it returns, not
        as its frame ends (a finalizer the candidate tied to one would run before the caller
        reads the times); `fn` empties it, armed, as the next call returns, inside its interval."""
        if not self.cuda:
            # The CPU close (see `cpu_close`): `after` (which registers outputs with `read_at_end`),
            # then one native call that reads every page, draws the positions and gathers the
            # values, all inside the interval. Nothing the candidate hooks into Python or ATen
            # can run between the draw and the read, and what it runs before the draw is timed.
            self.flush()
            if refill is not None:
                refill()
            reading = Reading(0, None)
            if mark is not None:
                mark()
            # the interval's start: the native open's clock, on the channel (where there is one) before the call
            t0_ns = self._native_open() if self._native_open else 0
            t0 = self._perf()
            if t0_ns < 0:
                raise TimerTamperedError("the timer's CPU open could not write the call's start to the channel")
            out = fn(*args)
            hooks = foreign_hooks()  # read inside the interval: a hook found here is never trusted
            self._reading = reading
            try:
                if after is not None:
                    after(out)
                else:
                    for t in out if isinstance(out, (list, tuple)) else (out,):
                        if type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided:
                            reading.add_cpu(t, 0, 0)  # read every page, sample none
            finally:
                self._reading = None
            failed, phase_ns, t1_ns = self._close_cpu(reading)
            if send is not None and not failed:
                send()
            elapsed_ms = self.host_ms = (self._perf() - t0) * 1e3
            if self._native_open is not None:  # the interval as the native open and close stamped it
                elapsed_ms = (t1_ns - t0_ns) / 1e6
            self._cpu_phase_ns = phase_ns
            if failed == -3:
                raise TimerTamperedError("the timer's CPU close could not write the call's evidence to the channel")
            if failed == -2:
                raise TimerTamperedError("the timer's CPU close could not read an output's memory (unmapped or "
                                         "protected when the call returned)")
            if failed:
                raise RuntimeError("the timer's CPU close failed (getrandom)")
            raw = vars(self)["last_raw"] = (elapsed_ms, phase_ns, reading.dense, reading.strided)
            ms = call_ms_from(self.calibration, *raw)
            if hooks:
                raise TimerTamperedError(f"a Python hook the harness did not set was active after the call: {hooks}")
            if held is not None:
                held.append([v for k, v in locals().items() if k != "held"])
            return out, ms
        # one stream for the gates, the events and the call (see `cudagym.sandbox.timing`): the caller's
        stream = torch.cuda.current_stream(self.device)
        marks = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        flush, words = (self._flush_buf, self._flush_buf.numel()) if self._flush_buf is not None else (self._gate, 0)
        self._sync()
        if self._cudart is not None:
            self._cudart.cudaCtxResetPersistingL2Cache()
        plan, n_copies = (copies, copies.numel() // 3) if copies is not None else (self._gate, 0)
        self._stamps.zero_()
        # the close kernel adds each output's projections here (zeroed now: no kernel of the harness's
        # between call and close)
        projections = (torch.zeros(MAX_SAMPLED_OUTPUTS, PROJECTIONS, dtype=torch.float64, device=self.device)
                       if after is not None else None)
        self._open(self._grid, self._block, [flush, words, self._gate, self._window_ns, plan, n_copies, self._stamps],
                   stream=stream)
        opened = self._perf()
        marks[0].record(stream)
        out = fn(*args)
        reading = Reading(_randbits(64), projections)  # the seed is drawn after the call returned
        if projections is not None:
            reading.host_projections = torch.zeros(MAX_SAMPLED_OUTPUTS, PROJECTIONS, dtype=torch.float64)
        with torch.cuda.stream(stream):  # the call may have left another stream current
            if after is not None:
                self._reading = reading
                try:
                    after(out)
                finally:
                    self._reading = None
            self._launch_close(reading.samples, stream)
            self.host_ms = (self._perf() - opened) * 1e3
            marks[1].record(stream)
            self._evidence_to_host(reading, stream)
        self._sync()
        reading.kept.clear()
        marks[2].record(stream)
        marks[2].synchronize()
        end_ms, last_ms = marks[0].elapsed_time(marks[1]), marks[0].elapsed_time(marks[2])
        raw = vars(self)["last_raw"] = (max(end_ms, last_ms - TAIL_ALLOWANCE_MS), self.read_phase_ns, reading.dense,
                                        reading.strided)
        read_ns = raw[1] if self.calibration.read_cap_ns else 0
        ms = call_ms(end_ms, last_ms, self.calibration.left_out_ns(read_ns, reading.dense, reading.strided))
        if held is not None:
            held.append([v for k, v in locals().items() if k != "held"])
        return out, ms

    @property
    def stamps_ns(self) -> tuple[int, int, int, int]:
        """The last call's device-clock stamps (ns; GPU): the open gate's end, the close gate's
        first and last block arriving and its last block leaving."""
        s = self._stamps.tolist()
        return (s[0], ~s[1] & (2**64 - 1), s[2], s[3])

    @property
    def read_phase_ns(self) -> int:
        """The last call's read phase: the close gate's last block's exit less its last arrival
        (ns; GPU); the native close's projection pass (CPU)."""
        if not self.cuda:
            return self._cpu_phase_ns
        _, _, last, leave = self.stamps_ns
        return leave - last  # (`Calibration.left_out_ns` bounds it)

    def read_at_end(self, t: torch.Tensor, count: int = SAMPLE_SIZE) -> Evidence:
        """`count` values of `t` at secret random flat (row-major) positions, and the positions;
        or, if `t` has no more than `count` elements, all its values in its shape, and None; on
        a GPU, with `t`'s projections (`projection`: over every element, with weights from the
        same seed).

        On a GPU, from `call`'s `after`: the close kernel reads them once it holds every SM, so
        nothing the call launched, on any stream, can still be writing `t` (a copy engine's copy
        is read half done) or start writing it before they are read; the positions and weights
        come from a seed drawn after the call returned. The tensors hold them once `call`
        returns. Elsewhere, and for outputs past `MAX_SAMPLED_OUTPUTS` in one call or of a dtype
        the close kernel does not project, they are read at once (on a GPU, still inside the
        call's interval).

        On the CPU target, from `call`'s `after`: registers `t` for the CPU close, which draws the
        positions and reads the values in one native call inside the interval; the evidence's
        tensors (and `raw` bytes) hold them once `call` returns (`Reading.add_cpu`). Outside a
        call, read at once with torch."""
        reading = self._reading
        if reading is not None and not self.cuda:
            return reading.add_cpu(t, count, PROJECTED_KINDS.get(t.dtype, 0))
        t = t.detach()
        everything = t.numel() <= count
        seed = reading.samples.seed if reading is not None else _randbits(64)
        index = reading.outputs if reading is not None else 0
        if reading is not None:
            reading.outputs += 1
        kind = PROJECTED_KINDS.get(t.dtype, 0)
        if (reading is None or not t.is_cuda or t.numel() == 0 or reading.samples.n >= MAX_SAMPLED_OUTPUTS
                or kind == 0 or reading.projections is None):
            projections = projection(t, seed, index)[:PROJECTIONS] if t.is_cuda else None
            if everything:
                return Evidence(t.clone(), None, projections, seed)
            gen = torch.Generator(device=t.device).manual_seed(seed & (2**62 - 1))
            idx = torch.randint(t.numel(), (count,), device=t.device, generator=gen)
            return Evidence(t.reshape(-1)[idx], idx, projections, seed)
        samples = reading.samples
        if t.dim() > MAX_SAMPLED_DIMS and not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() if everything else count
        values = torch.empty(n, dtype=t.dtype, device=t.device)
        positions = None if everything else torch.empty(n, dtype=torch.int64, device=t.device)
        shape, strides = ([t.numel()], [1]) if t.is_contiguous() else (list(t.shape), list(t.stride()))
        projections = reading.projections[samples.n]
        # the evidence is the host copies (`_evidence_to_host`), filled once `call` returns
        host_values = torch.empty(n, dtype=t.dtype)
        host_positions = None if positions is None else torch.empty(n, dtype=torch.int64)
        reading.to_host += [(values.data_ptr(), host_values.data_ptr(), values.nbytes)]
        if positions is not None and host_positions is not None:
            reading.to_host += [(positions.data_ptr(), host_positions.data_ptr(), positions.nbytes)]
        host_projections = reading.host_projections[samples.n] if reading.host_projections is not None else projections
        s = samples.out[samples.n]
        s.src, s.values, s.positions = t.data_ptr(), values.data_ptr(), 0 if positions is None else positions.data_ptr()
        s.proj, s.kind, s.index = projections.data_ptr(), kind, index
        s.numel, s.count, s.elem_size, s.ndim = t.numel(), n, t.element_size(), len(shape)
        for d, (size, stride) in enumerate(zip(shape, strides)):
            s.sizes[d], s.strides[d] = size, stride
        samples.n += 1
        if t.is_contiguous():
            reading.dense += max(t.numel(), t.numel() * t.element_size() // 4)
        else:
            reading.strided += t.numel()
        # alive until copied (the caller may drop the evidence at once, as the calibration does)
        reading.kept += [t, values, host_values]
        if positions is not None and host_positions is not None:
            reading.kept += [positions, host_positions]
        return Evidence(host_values.view(t.shape) if everything else host_values, host_positions, host_projections,
                        seed)

    def _close_cpu(self, reading: Reading) -> tuple[int, int, int]:
        """The CPU close of `reading`'s outputs: the harness's native `cpu_close` where the timer
        has it (every worker's timer), else the same steps in torch (tests and tools only: its
        draw and reads are ATen ops, which a candidate's RecordFunction callback sees). Returns
        the close's code (0; -1: no random bytes; -2: an output's memory could not be read; -3:
        the channel refused the evidence), its projection pass's duration (ns) and, native, its
        clock at the end (ns). In a timing job's worker (`native_channel`) the native close sends the
        call's end, seed and evidence itself (`Reading.layout`: what each output is); the
        projections of a dtype it does not project are made here, after it, and go with `send`."""
        entries = reading.cpu
        if self._native_close is not None:
            array = (CpuClose * max(len(entries), 1))(*(e for e, _ in entries))
            stamps = (ctypes.c_int64 * 2)()
            layout = reading.layout()
            code = int(self._native_close(ctypes.addressof(array), len(entries), stamps, layout, len(layout)))
            for k, (entry, (t, ev)) in enumerate(entries):
                entry.seed = array[k].seed
                if code == 0 and ev is not None and ev.projections is not None and entry.kind == 0:
                    ev.projections.copy_(projection(t, entry.seed, int(entry.index))[:PROJECTIONS])
            return code, int(stamps[0]), int(stamps[1])
        seed = _randbits(64)
        t0 = time.perf_counter_ns()
        for entry, (t, ev) in entries:
            entry.seed = seed
            touch_pages(t)
            if ev is None or entry.count == 0:
                continue
            flat = t.reshape(-1)
            if ev.positions is None:
                ev.values.copy_(t)
            else:
                gen = torch.Generator().manual_seed(seed & (2**62 - 1))
                ev.positions.copy_(torch.randint(t.numel(), (entry.count,), generator=gen))
                ev.values.copy_(flat[ev.positions])
            if ev.projections is not None:
                ev.projections.copy_(projection(t, seed, int(entry.index))[:PROJECTIONS])
        return 0, time.perf_counter_ns() - t0, 0

    def _evidence_to_host(self, reading: Reading, stream: torch.cuda.Stream) -> None:
        """Copy what the close kernel read (samples, positions, projections) to the host's
        pageable memory, on the call's stream right after the close kernel and its end event:
        no kernel can write it there (a candidate's kernel that would rewrite the device copy
        must first compute the whole output to match the projections, and the copy follows the
        close at once; one that holds the copy up holds the device-wide synchronize, and so the
        last event, which then times the call)."""
        if reading.samples.n and reading.host_projections is not None and reading.projections is not None:
            reading.to_host.append((reading.projections.data_ptr(), reading.host_projections.data_ptr(),
                                    reading.projections.nbytes))
        for dev, host, nbytes in reading.to_host:
            err = self._to_host(ctypes.c_void_p(host), ctypes.c_uint64(dev), ctypes.c_size_t(nbytes),
                                stream._as_parameter_)
            if err:
                raise RuntimeError(f"the timer's evidence copy failed: CUDA driver error {err}")

    def _launch_close(self, samples: Samples, stream: torch.cuda.Stream) -> None:
        """The close kernel on `stream` (launched here: torch's kernel handles pass no structs
        by value)."""
        params = (ctypes.c_void_p(self._gate.data_ptr()), ctypes.c_uint(self._blocks), ctypes.c_uint(CLOSE_TIMEOUT_NS),
                  ctypes.c_void_p(self._stamps.data_ptr()), samples)
        pointers = (ctypes.c_void_p * len(params))(*(ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params))
        err = self._launch(self._close.func, self._blocks, 1, 1, GATE_THREADS, 1, 1, 0,
                                           stream._as_parameter_, pointers, None)
        if err:
            raise RuntimeError(f"the timer's close kernel failed to launch: CUDA driver error {err}")

    def calibrate(self, calls: int | None = None) -> Calibration:
        """Measure this timer's overhead and leave it out of its calls from now on; returns it.

        The median over `calls` (default `CALIBRATION_CALLS`) calls that launch nothing, an output
        read at the call's end as a call's is, through this timer's gate, flush and window, of the
        call's interval less its read phase: capped at `MAX_OVERHEAD_NS`; the read phase's median
        plus `READ_SLACK_NS` caps what is left out of a call for its own. Then
        `LARGE_CALIBRATION_CALLS` such calls with a contiguous output of `LARGE_CALIBRATION_ELEMENTS`
        and as many with a transposed one of `STRIDED_CALIBRATION_ELEMENTS`: the read phase's
        growth per element projected (plus `READ_SLACK_REL`) raises that cap for a call with
        larger outputs. Run it before any candidate code loads. On the CPU target the read phase
        is the native close's projection pass, measured with fewer and smaller calls
        (`CPU_CALIBRATION`: a timing job calibrates its own timer)."""
        base, large, strided_n, large_calls = ((CALIBRATION_ELEMENTS, LARGE_CALIBRATION_ELEMENTS,
                                                STRIDED_CALIBRATION_ELEMENTS, LARGE_CALIBRATION_CALLS)
                                               if self.cuda else CPU_CALIBRATION[1:])
        if calls is None:
            calls = CALIBRATION_CALLS if self.cuda else CPU_CALIBRATION[0]
        output = torch.zeros(base, device=self.device)  # read at each call's end as a call's output is

        def read(_: Any) -> None:
            self.read_at_end(output)

        self.calibration = Calibration(0, 0)
        for _ in range(5):
            self.call(lambda: None, [], read)
        timed = []
        for _ in range(calls):
            ms = self.call(lambda: None, [], read)[1]
            phase_ns = self.read_phase_ns
            timed.append((ms * 1e6 - phase_ns, phase_ns, self.host_ms or 0.0))
        # a call the host launched after the window's end holds that lateness: not the timer's own
        on_time = [t for t in timed if t[2] <= self.window_ms] or timed
        read_ns = statistics.median(t[1] for t in on_time)

        def read_phase(t: torch.Tensor) -> float:
            phases = []
            for _ in range(large_calls):
                self.call(lambda: None, [], lambda _: self.read_at_end(t))
                phases.append(self.read_phase_ns)
            return statistics.median(phases)

        dense = read_phase(torch.zeros(large, device=self.device))
        side = int(strided_n ** 0.5)
        strided = read_phase(torch.zeros(side, side, device=self.device).t())
        self.calibration = Calibration.measured(
            statistics.median(t[0] for t in on_time), read_ns,
            (dense - read_ns) * 1000 / (large - base), (strided - read_ns) * 1000 / (side * side),
            base)
        return self.calibration

    def close_timeouts(self) -> int:
        """Calls so far whose close kernel gave up (timed to the device-wide synchronize)."""
        return int(self._gate[2].item()) if self.cuda else 0


def _randbits(k: int) -> int:
    """`k` secret random bits (the calls' seeds of positions and weights)."""
    return secrets.randbits(k)


def call_ms(end_ms: float, last_ms: float, left_out_ns: int) -> float:
    """A GPU call's time from its events (ms after the start event): to the end event, or to
    the last event less the host's allowance if that is later (the close kernel gave up), less
    what the timer leaves out (its overhead and the call's read phase)."""
    return max(max(end_ms, last_ms - TAIL_ALLOWANCE_MS) - left_out_ns / 1e6, 0.0)


@functools.cache
def harness_calibration() -> Calibration:
    """The harness's overhead on this process's GPU, measured on a timer of its own without the
    L2 flush (`DeviceTimer.calibrate`); measured once per process (a timing job measures it
    again, `harness.job_timer`)."""
    return DeviceTimer(torch.device("cuda"), flush_l2=False, calibration=Calibration(0, 0)).calibrate()


# bound as the harness is imported: a buffer's own `copy_` would be looked up in its instance dict
# first, where candidate code that holds the buffer (an argument of forward) can put one (red team
# 19's a ran torch's GELU on each next call's inputs there, as the harness refilled the buffer)
_COPY = torch.Tensor.copy_


def refill_(buffers: Sequence[Any], fresh: Sequence[Any]) -> None:
    """Copy fresh values into existing input buffers (tensors in place; other args unchanged)."""
    for b, f in zip(buffers, fresh):
        if isinstance(b, torch.Tensor) and isinstance(f, torch.Tensor):
            _COPY(b, f)


def drive_calls(
    fn: Callable[..., Any],
    input_sets: list[list[Any]],
    inputs_for: Callable[[int], list[Any]],
    next_call: Callable[[tuple[tuple[str, Any], ...]], tuple[int, bool, float] | None],
    timer: DeviceTimer,
    after: Callable[[int, Any], dict[str, Any]] | None = None,
    probe: Callable[..., Any] | None = None,
    send: Callable[[], object] | None = None,
    mark: Callable[[], object] | None = None,
    held: list[Any] | None = None,
) -> int:
    """Make the calls the parent asks for; returns how many were made.

    `next_call(report)` asks the parent for the next call, reporting the previous one (`()`
    before the first; then (name, value) pairs: its time "ms", "host_ms" (`timer.host_ms`), its raw
    measurements, and what `after(i, out)` returned), and returns the seed of the
    next call's inputs, whether it is a probe (`probe` is called instead of `fn`: the
    parent measures the loop's own overhead on it) and how long to idle before it (seconds;
    server mode), or None to stop. Call i's buffers
    `input_sets[i % k]` are refilled with `inputs_for(seed)`: on the CPU target after the cache
    flush, right before the interval opens (`DeviceTimer.call`'s `refill`); on a GPU, by the
    open gate at the end of the launch window, from a staging copy (a buffer it cannot copy, a
    non-contiguous one, is refilled before the call). On a GPU an allocation of
    `PLACEMENT_BYTES[(i // k) % 8]` is held across call i, so that the call's own allocations
    land elsewhere from one round of input sets to the next. `after(i, out)` runs once call
    i has returned (`DeviceTimer.call`'s `after`: it reads outputs with `read_at_end`) and returns
    what to report about it; on the CPU target `send()` sends what it read from inside the
    interval (`DeviceTimer.call`'s `send`), and `mark()` runs right before each interval opens.
    The garbage collector is paused so that a collection does not land inside a call.
    `held`: where each call's objects stay until `fn` empties it as the next call returns, inside
    its interval (see the loop's text); the last call's go as the loop ends.
    """
    k = len(input_sets)
    # GPU: the fresh values go to a staging copy, which the open gate copies into the call's
    # buffers at the end of the launch window (see `cudagym.sandbox.timing`)
    first = input_sets[0] if input_sets else []
    stage = [a.clone() if all(timer.stages(b[j]) and b[j].nbytes == a.nbytes for b in input_sets) else None
             for j, a in enumerate(first)]
    plans = [timer.copy_plan([(s, a) for s, a in zip(stage, args) if s is not None]) for args in input_sets]
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        report: tuple[tuple[str, Any], ...] = ()
        i = 0
        # Each call's objects (its output, its inputs as made, the hook, the targets, the report,
        # the timer's own) are moved into `held` as the call returns and live nowhere else: the
        # candidate's code can reach them all (up the stack, from forward), and a finalizer it ties
        # to one (`weakref.finalize`, an object with `__del__` put in a list or a dict of the loop's)
        # runs where that object dies. `held` is emptied as the next call returns, inside its
        # interval, armed (`fn` does it): such code runs timed and audited, never between a call and its report
        # (which it could rewrite) or between the next seed and the interval (where it could
        # compute the next output: red team 16's c and d ran torch's GELU there, from finalizers of
        # the last inputs and of the last output, calling `inputs_for` on the seed it read here).
        held = [] if held is None else held
        while (asked := next_call(report)) is not None:
            del report
            gc.disable()  # forward may have resumed the collector
            seed, is_probe, idle_s = asked
            if idle_s > 0:
                time.sleep(idle_s)  # server mode: the call arrives after a gap (nothing is timed here)
            args = input_sets[i % k]
            fresh = inputs_for(seed)
            targets = [s if s is not None else a for s, a in zip(stage, args)]
            if timer.cuda:  # the open gate copies the staged values at the window's end
                refill_(targets, fresh)
            seen: dict[str, Any] = {}
            hook = None if after is None else (lambda out, i=i: seen.update(after(i, out)))
            spacer = (torch.empty(PLACEMENT_BYTES[(i // k) % len(PLACEMENT_BYTES)], dtype=torch.uint8,
                                  device=timer.device)
                      if timer.cuda else None)
            out, ms = timer.call(probe if is_probe and probe is not None else fn, args, hook, plans[i % k],
                                 refill=None if timer.cuda else functools.partial(refill_, targets, fresh),
                                 send=None if timer.cuda else send, mark=None if timer.cuda else mark, held=held)
            span_ms, read_ns, dense, strided = vars(timer)["last_raw"]  # not through a class attribute
            # a tuple: nothing of the candidate's that runs before the report leaves (a hook on a
            # read of `next_call`'s, found up the stack) can edit it in place (red team 28's a1-a12
            # rewrote the report's dict from `next_call`'s frame)
            report = (("ms", ms), ("host_ms", timer.host_ms), ("span_ms", span_ms), ("read_ns", read_ns),
                      ("dense", dense), ("strided", strided), *seen.items())
            held.append((out, fresh, targets, seen, hook, spacer, report))
            del out, fresh, targets, hook, spacer
            i += 1
        return i
    finally:
        if gc_was_enabled:
            gc.enable()
