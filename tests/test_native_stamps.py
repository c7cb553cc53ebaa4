"""A CPU timed call's stamps and evidence leave from the harness's native code (CPU target, real
workers, builds and pipes).

The native open reads the clock and writes it on the channel before the candidate's forward runs;
the native close reads the outputs, reads the clock and writes the end, the seed and everything it
read before it returns (`cudagym_cpu_open`/`cudagym_cpu_close` in opwatch.cpp). The parent computes
each call's time from those stamps (`FrameReader.stamped`, `CallFeed`), not from the report the
worker's Python sends after its per-call checks. Red team 30's a19 rewrote that report's floats in
place, through `ctypes`, from a one-shot link that ran after the close and before the report left.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.feed import native_raw
from cudagym.sandbox.opwatch import CHANNEL_FD, OpWatch
from cudagym.sandbox.protocol import Calibration
from cudagym.sandbox.timing import DeviceTimer
from cudagym.rewards.compare import decode_tensor
from cudagym.sandbox.worker.wire import FrameReader, encode_frame, native_layout

from test_reward_hacking import GELU, GELU_KERNELS, gelu_model
from test_timed_loop_finalizers import IN_THE_LOOP


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_by_parent(write: Callable[[int], None]) -> tuple[FrameReader, list[dict[str, Any]]]:
    """The parent's real frame reader after `write(fd)` wrote a worker's frames on a pipe (after
    its ready frame), and the requests it answered (with `{}`)."""
    read_fd, write_fd = os.pipe()
    answers_r, answers_w = os.pipe()
    loop = asyncio.new_event_loop()
    reader = FrameReader(read_fd, loop, 1 << 26)
    requests: list[dict[str, Any]] = []
    reader.responder = lambda request, arrived: requests.append(dict(request)) or {}
    reader.answer_fd = answers_w
    try:
        try:
            os.write(write_fd, encode_frame({"type": "ready"}))
            write(write_fd)
        finally:
            os.close(write_fd)
        loop.run_until_complete(asyncio.wait_for(reader.done, 30))
    finally:
        reader.stop()
        loop.close()
        os.close(answers_w)
        _read_all(answers_r)
        os.close(answers_r)
    return reader, requests


def _frames_read(frames: list[dict[str, Any]], payloads: dict[int, bytes] | None = None) -> FrameReader:
    """The parent's frame reader after it read `frames` (each a header; `payloads[i]` for frame i)."""
    def write(fd: int) -> None:
        for i, head in enumerate(frames):
            os.write(fd, encode_frame(head, (payloads or {}).get(i, b"")))

    return _read_by_parent(write)[0]


def test_the_native_open_and_close_send_the_calls_stamps_and_evidence(eval_cache: Path) -> None:
    """A real timer with the channel at `CHANNEL_FD`, read by the parent's real frame reader: the
    open's stamp, then the close's, whose payload comes back as the sample, positions and
    projection frames of the call asked for last; the stamps are the interval the timer reports."""
    watch = OpWatch.load(eval_cache)
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, calibration=Calibration(0, 0),
                        native_close=watch.cpu_close, native_open=watch.cpu_open, native_channel=True)
    out = torch.randn(5000)
    evidence: list[Any] = []
    times: list[float] = []

    def worker(fd: int) -> None:
        os.write(fd, encode_frame({"type": "request", "what": "calibration", "native_stamps": True}))
        os.write(fd, encode_frame({"type": "request", "what": "call", "role": "candidate", "index": 0}))
        os.dup2(fd, CHANNEL_FD)
        try:
            times.append(timer.call(lambda: out, [], lambda o: evidence.append(timer.read_at_end(o)))[1])
        finally:
            os.close(CHANNEL_FD)
        os.write(fd, encode_frame({"type": "request", "what": "call", "role": "candidate", "index": 1,
                                   "stamps": "forged"}))

    reader, requests = _read_by_parent(worker)
    (ms,) = times
    assert reader.error is None
    assert [r.get("stamps") for r in requests][:2] == [[], []]
    stamps = requests[2]["stamps"]  # what the worker put there is replaced
    assert [s["what"] for s in stamps] == ["open", "close"]
    raw = native_raw(stamps)
    assert not isinstance(raw, str)
    assert raw[0] == pytest.approx(ms, abs=1e-9)  # the timer's own time is the stamps' interval
    assert raw[2] == 5000
    frames = {h["role"]: (h, p) for h, p in reader.frames}
    assert set(frames) == {"sample", "positions", "projection"}
    (ev,) = evidence
    for role, want in (("sample", ev.values), ("positions", ev.positions), ("projection", ev.projections)):
        h, p = frames[role]
        assert h["trial"] == 0 and h["index"] == 0
        assert torch.equal(decode_tensor(h, p), want), role
    assert frames["projection"][0]["seed"] == ev.cpu_seed() != 0
    assert frames["sample"][0]["full_shape"] == [5000]


def test_a_close_whose_bytes_are_not_its_layouts_is_refused() -> None:
    """A close written by the candidate cannot carry the harness's own close inside its payload:
    every byte of a close is an output's samples, positions or projections, as many as its layout
    says (red team 31's reading of the frame format)."""
    meta = {"index": 0, "dtype": "float32", "shape": [2048], "full_shape": [64, 64]}
    pieces = native_layout([meta], [[8192, 16384, 32]], 8192 + 16384 + 32)
    assert not isinstance(pieces, str)
    assert [(h["role"], n) for h, n in pieces] == [("sample", 8192), ("positions", 16384), ("projection", 32)]
    small = {"index": 0, "dtype": "float32", "shape": [4, 4], "full_shape": [4, 4]}
    assert not isinstance(native_layout([small, None], [[64, 0, 32], [0, 0, 0]], 96), str)
    for layout, sizes, payload in (
            ([meta], [[8192, 16384, 32]], 8192 + 16384 + 32 + 200),  # 200 bytes more than the outputs take
            ([meta], [[8192 + 200, 16384, 32]], 8192 + 16384 + 32 + 200),  # hidden among the samples
            ([{**meta, "shape": [2098]}], [[8392, 16784, 32]], 8392 + 16784 + 32),  # more samples than drawn
            ([meta, meta], [[8192, 16384, 32]] * 2, 2 * (8192 + 16384 + 32)),  # output 0 twice
            ([small], [[64, 0, 64]], 128),  # projections of 8 doubles
            ([None], [[8, 0, 0]], 8),  # bytes of an output read without samples
            ([{**small, "dtype": "float33"}], [[64, 0, 32]], 96)):
        assert isinstance(native_layout(layout, sizes, payload), str), (layout, sizes)


def test_a_natively_stamped_calls_frames_come_in_the_harnesss_order() -> None:
    """Start mark, open, close, (projections), end mark, request: a mark or stamp of the candidate's
    anywhere else in the call is refused as it arrives."""
    calibration = {"type": "request", "what": "calibration", "native_stamps": True}
    ask = {"type": "request", "what": "call", "role": "candidate", "index": 0}
    forward, returned = {"type": "mark", "what": "forward"}, {"type": "mark", "what": "returned"}
    opened = {"type": "stamp", "what": "open", "ns": 5}
    closed = {"type": "stamp", "what": "close", "layout": [], "ns": 9, "phase_ns": 1, "dense": 0, "seed": 3,
              "sizes": []}
    kind0 = {"type": "tensor", "role": "projection", "trial": 0, "index": 0, "dtype": "float64", "shape": [4]}
    again = {**ask, "index": 1}
    honest = [calibration, ask, forward, opened, closed, kind0, returned, again]
    assert _frames_read(honest, {5: bytes(32)}).error is None
    assert _frames_read([calibration, ask, opened, closed, again]).error is None  # a baseline's call: no marks
    for frames in ([calibration, ask, forward, opened, returned, closed, again],  # the window ended before the close
                   [calibration, ask, forward, opened, closed, again],  # no end mark
                   [calibration, ask, forward, forward, opened, closed, returned, again],
                   [calibration, ask, forward, opened, opened, closed, returned, again],
                   [calibration, ask, forward, opened, closed, closed, returned, again],
                   [calibration, ask, forward, opened, closed, returned, returned, again],
                   [calibration, ask, forward, opened, closed, {"type": "mark", "what": "other"}, returned, again],
                   [calibration, ask, opened, closed, returned, again]):
        reader = _frames_read(frames)
        assert reader.error is not None and "order" in reader.error, frames
    assert "out of the harness's order" in str(_frames_read([calibration, ask, forward, opened, closed,
                                                              {**kind0, "shape": [8]}, returned, again],
                                                             {5: bytes(64)}).error)
    assert _frames_read([calibration, ask, forward, opened, {"type": "final", "ok": False}]).error is None


def test_a_calls_stamps_must_be_one_open_then_one_close() -> None:
    opened = {"what": "open", "ns": 1_000, "arrived_s": 0.0}
    closed = {"what": "close", "ns": 6_000, "phase_ns": 10, "dense": 7, "seed": 3, "arrived_s": 0.0}
    assert native_raw([opened, closed]) == [0.005, 10, 7, 0]
    for stamps in ([], [opened], [closed], [opened, opened, closed], [opened, closed, closed], [closed, opened]):
        assert "not one open and one close" in str(native_raw(stamps))
    assert "malformed" in str(native_raw([opened, {**closed, "ns": 500}]))
    assert "malformed" in str(native_raw([opened, {**closed, "dense": 1.5}]))


# Red team 30's a19, through a link this test keeps open on purpose: `builtins.type`, replaced from
# forward by a fake that puts the original back when the loop's `returned()` calls it, after the
# call's close and before its report leaves. There it halves the report's floats in place.
REPORT_REWRITE = IN_THE_LOOP + """\
import builtins
import ctypes

_real_type = builtins.type
_done = {"rewrites": 0, "calls": 0}


def _fake_type(*args):
    if len(args) == 1 and sys._getframe(1).f_code.co_name == "returned":
        builtins.type = _real_type
        report = sys._getframe(2).f_locals.get("report")
        for name, value in report or ():
            if name in ("ms", "span_ms", "host_ms") and _real_type(value) is float:
                ctypes.c_double.from_address(id(value) + 16).value = value / 2
                _done["rewrites"] += 1
    return _real_type(*args)


def _link():
    if _loop_frame() is None:
        return
    _done["calls"] += 1
    if _done["calls"] > 3 and not _done["rewrites"]:
        raise RuntimeError("the link never ran")
    if builtins.type is _real_type:
        builtins.type = _fake_type
"""


def test_a_report_rewritten_after_the_close_does_not_change_the_calls_time(evaluator: Evaluator, build_ws) -> None:
    """The link runs (the rewrites happen: the candidate raises otherwise), and the kernel is
    rewarded and timed as the honest one: the parent takes each call's time from the native stamps,
    so the halved report changes nothing (the old loop refused it: its time was under the parent's
    window by more than the window rule allows, and a cut within that bound would have passed)."""
    honest = evaluator.evaluate(GELU, build_ws(GELU, gelu_model("return run_kernel(x, self.bias, self.scale)"),
                                               GELU_KERNELS))
    body = "_link()\nreturn run_kernel(x, self.bias, self.scale)"
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(body, extra=REPORT_REWRITE), GELU_KERNELS))
    assert "never ran" not in (v.error or "") + "".join(v.reasons)
    assert v.reward >= 1 and honest.reward >= 1, (v.reasons, honest.reasons)
    assert v.profile_result is not None and honest.profile_result is not None
    assert v.profile_result.candidate is not None and honest.profile_result.candidate is not None
    ratio = v.profile_result.candidate.median_ms / honest.profile_result.candidate.median_ms
    assert ratio > 0.7, (ratio, v.reasons)  # the halved report would read about 0.5


# The candidate writes a close of its own on the channel during forward, claiming the call ended
# at once; the harness's own close follows it.
FORGED_CLOSE = IN_THE_LOOP + """\
import json
import os
import struct
import time


def _forge():
    if _loop_frame() is None:
        return
    head = json.dumps({"layout": [], "type": "stamp", "what": "close", "ns": time.monotonic_ns(), "phase_ns": 0,
                       "dense": 0, "seed": 1, "sizes": []}).encode()
    os.write(1000, struct.pack("<I", len(head)) + head + struct.pack("<Q", 0))
"""

# Or a frame of another kind whose payload would take in the harness's close that follows it.
SWALLOW = IN_THE_LOOP + """\
import json
import os
import struct


def _swallow():
    if _loop_frame() is None:
        return
    head = json.dumps({"type": "tensor", "role": "log", "trial": 0, "index": 9, "dtype": "uint8",
                       "shape": [1 << 16]}).encode()
    os.write(1000, struct.pack("<I", len(head)) + head + struct.pack("<Q", 1 << 16))
"""


# Or an end mark of its own, sent before the harness's close, which would end the parent's window there.
RETURNED = IN_THE_LOOP + """\
import json
import os
import struct


def _returned():
    if _loop_frame() is None:
        return
    head = json.dumps({"type": "mark", "what": "returned", "wait": False, "at": 0.0}).encode()
    os.write(1000, struct.pack("<I", len(head)) + head + struct.pack("<Q", 0))
"""


@pytest.mark.parametrize("how", ["forged", "swallow", "returned"])
def test_a_frame_the_candidate_writes_in_a_call_is_refused(evaluator: Evaluator, build_ws, how: str) -> None:
    extra, call = {"forged": (FORGED_CLOSE, "_forge()"), "swallow": (SWALLOW, "_swallow()"),
                   "returned": (RETURNED, "_returned()")}[how]
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(f"{call}\nreturn run_kernel(x, self.bias, self.scale)",
                                                            extra=extra), GELU_KERNELS))
    assert v.reward < 0, v.reasons
    text = "\n".join([*v.reasons, v.error or ""])
    assert "out of the harness's order in a natively stamped call" in text, text


# To send its own close instead of the harness's, the candidate would put another pipe at the
# channel's descriptor (or at the worker's own channel or answers descriptor) while forward runs.
REDIRECT = IN_THE_LOOP + """\
import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
_tried = {"refused": 0}


def _redirect(target):
    if _loop_frame() is None:
        return
    spare = os.pipe()
    for how in ("dup2", "dup3", "close", "close_range"):
        if how == "dup2":
            rc = _libc.dup2(spare[1], target)
        elif how == "dup3":
            rc = _libc.dup3(spare[1], target, 0)
        elif how == "close":
            rc = _libc.close(target)
        else:
            rc = _libc.syscall(436, target, target, 0)  # close_range (x86_64)
        if rc >= 0:
            raise RuntimeError(f"redirected the channel with {how}")
        if ctypes.get_errno() != errno.EPERM:
            raise RuntimeError(f"{how}: errno {ctypes.get_errno()}")
        _tried["refused"] += 1
    if _libc.syscall(425, 8, None) >= 0 or ctypes.get_errno() != errno.EPERM:  # io_uring_setup
        raise RuntimeError("io_uring was set up")
    # a filter of its own (here one that allows everything), by either call, or tracing
    allow = (ctypes.c_uint16 * 4)(0x06, 0, 0, 0)  # BPF_RET | BPF_K, SECCOMP_RET_ALLOW (0x7fff0000)
    allow_k = ctypes.c_uint32.from_buffer(allow, 4)
    allow_k.value = 0x7FFF0000
    prog = (ctypes.c_uint64 * 2)(1, ctypes.addressof(allow))
    for name, rc in (("seccomp", _libc.syscall(317, 1, 0, ctypes.byref(prog))),
                     ("prctl", _libc.prctl(22, 2, ctypes.byref(prog), 0, 0)),
                     ("ptrace", _libc.ptrace(0, 0, None, None))):
        if rc >= 0 or ctypes.get_errno() != errno.EPERM:
            raise RuntimeError(f"{name}: {rc}, errno {ctypes.get_errno()}")
    os.close(spare[0])
    os.close(spare[1])
"""


@pytest.mark.parametrize("target", ["1000", "3"])
def test_the_channels_descriptors_cannot_be_replaced_or_closed(evaluator: Evaluator, build_ws, target: str) -> None:
    """The channel guard (a seccomp filter installed before the candidate loads) refuses every way
    to put another file at the native channel's descriptor or at the worker's result pipe (3), or to
    close them, and a filter of the candidate's own (red team 32's held the harness's writes for a thread
    of its own to rewrite) or tracing: the candidate stays honest and is rewarded as such."""
    body = f"_redirect({target})\nreturn run_kernel(x, self.bias, self.scale)"
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(body, extra=REDIRECT), GELU_KERNELS))
    assert v.reward >= 1, (v.reasons, v.error)


def test_the_address_a_native_function_of_the_timer_calls_is_checked(eval_cache: Path) -> None:
    """Red team 33's a4 pointed the timer's native open, a ctypes function object, at a function of
    its own (the object unchanged, so identity checks held): the per-call checks compare the
    address it calls (`integrity.c_entries`)."""
    import ctypes

    from cudagym.sandbox.worker.integrity import c_entries, entries_changed

    watch = OpWatch.load(eval_cache)
    entries = c_entries([watch.cpu_open, watch.cpu_close])
    assert len(entries) == 2 and not entries_changed(entries)
    slot = ctypes.c_void_p.from_address(ctypes.addressof(watch.cpu_open))
    original = slot.value
    try:
        slot.value = watch.cpu_flush and ctypes.cast(watch.cpu_flush, ctypes.c_void_p).value
        assert entries_changed(entries)
    finally:
        slot.value = original
    assert not entries_changed(entries)
