"""The timing protocol, run inside a worker.

Per timed call, in this order: refill the call's input buffers with fresh random values (same
pointers, new contents, so neither pointer- nor content-keyed result caches can replay), flush
the L2 cache by zeroing a buffer twice its size (CPU: a buffer larger than the LLC), reset
persisting L2 lines, synchronize the device, record a start event, call, synchronize the whole
device (so work on side streams is inside the interval), record the end event. Warm-up calls
come first and are indistinguishable from timed ones to the callee. Returns per-call times in
milliseconds; statistics are computed by the parent (`TimingStats`).
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cudagym.sandbox.protocol import TimingConfig


def _cudart() -> Any | None:
    import glob
    import os

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


class DeviceTimer:
    """Times one call at a time on `device` (cuda:N or cpu) under the protocol above."""

    def __init__(self, device: torch.device, flush_l2: bool = True, stream_diagnostic: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self._event = torch.cuda.Event if self.cuda else None
        self._elapsed = torch.cuda.Event.elapsed_time if self.cuda else None
        self._perf = time.perf_counter
        # diagnostic, off by default (an extra event inside the timed interval): per call, start
        # to the caller's stream being done, without the device-wide synchronize's wake-up
        self.stream_ms: list[float] | None = [] if stream_diagnostic and self.cuda else None
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
            self._flush_buf = torch.empty(max(2 * l2, 64 * 2**20) // 4, dtype=torch.int32, device=device) if flush_l2 else None
            self._cudart = _cudart()
        else:
            self._flush_buf = torch.empty(64 * 2**20 // 4, dtype=torch.int32) if flush_l2 else None
            self._cudart = None

    def flush(self) -> None:
        if self._flush_buf is not None:
            self._flush_buf.zero_()
        if self._cudart is not None:
            self._cudart.cudaCtxResetPersistingL2Cache()

    def time_call_ms(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[float, Any]:
        self.flush()
        self._sync()
        if self.cuda:
            start, end = self._event(enable_timing=True), self._event(enable_timing=True)
            on_stream = self._event(enable_timing=True) if self.stream_ms is not None else None
            start.record()
            out = fn(*args)
            if on_stream is not None:
                on_stream.record()
            self._sync()
            end.record()
            end.synchronize()
            if on_stream is not None:
                self.stream_ms.append(float(self._elapsed(start, on_stream)))
            return float(self._elapsed(start, end)), out
        t0 = self._perf()
        out = fn(*args)
        return (self._perf() - t0) * 1e3, out


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
    keep: Callable[[int, list[Any], Any], None] | None = None,
) -> list[float]:
    """Warm up, then time calls until `cfg.target_ms` or `cfg.max_calls`; returns times in ms.

    Warm-up lasts `cfg.warmup_calls` calls and at least `cfg.warmup_ms` of wall-clock time (so
    clocks leave their idle state however short the call). The garbage collector is paused so
    that a collection does not land inside a timed call. `keep(i, inputs, out)` is called after
    timed call i (outside the timed interval) so the caller can keep some outputs for re-checks.
    """
    k = len(input_sets)
    clock = timer._perf
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        t0, i = clock(), 0
        while i < cfg.warmup_calls or ((clock() - t0) * 1e3 < cfg.warmup_ms and i < cfg.max_calls):
            refill_(input_sets[i % k], fresh_inputs())
            timer.time_call_ms(fn, input_sets[i % k])
            i += 1
        times: list[float] = []
        spent = 0.0
        i = 0
        while i < cfg.max_calls and (i < cfg.min_calls or spent < cfg.target_ms):
            args = input_sets[i % k]
            refill_(args, fresh_inputs())
            ms, out = timer.time_call_ms(fn, args)
            times.append(ms)
            spent += ms
            if keep is not None:
                keep(i, args, out)
            del out
            i += 1
        return times
    finally:
        if gc_was_enabled:
            gc.enable()
