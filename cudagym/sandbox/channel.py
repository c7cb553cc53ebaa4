"""The result channel of a worker, as the parent sees it: shared by every sandbox backend.

A worker writes frames (`cudagym.sandbox.protocol`) on a pipe or FIFO and tensor bytes into a
result-memory file; the parent reads the frames on a thread as they arrive (answering request
frames on the worker's stdin), and maps the result memory only once the worker is gone.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from cudagym.sandbox.base import JobOutcome, Responder
from cudagym.sandbox.protocol import FrameError, read_frame


class FrameReader:
    """Reads one worker's result pipe on its own thread, frame by frame.

    Frames are small (tensor bytes go through the worker's result memory); a payload that does
    come on the pipe is read straight into its own buffer.
    `ready` resolves at the worker's ready frame; `done` when the pipe closes or `stop()`.
    `startup_s` then holds the seconds of each of the worker's start-up steps (its own clocks) and
    `wall`, from `started` (when the worker was asked for; default: now) to the ready frame.
    Request frames are answered here, as they arrive, by the job's responder (see
    `Sandbox.run`), on the worker's stdin (`answer_fd`); `requests` counts them.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, max_bytes: int, started: float | None = None):
        self._fd, self._loop, self._budget = fd, loop, max_bytes
        self.ready: asyncio.Future[bool] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.final_seen: asyncio.Future[None] = loop.create_future()  # the harness's result arrived
        self.frames: list[tuple[dict[str, Any], memoryview]] = []
        self.error: str | None = None  # a malformed frame (not a worker that died mid-frame)
        self.responder: Responder | None = None  # set when the job starts
        self.answer_fd: int | None = None
        self.requests = 0
        self.startup_s: dict[str, float] = {}
        self._started = time.perf_counter() if started is None else started
        self._stop = threading.Event()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        threading.Thread(target=self._run, name="cudagym-frames", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _read_into(self, view: memoryview) -> bool:
        while len(view):
            while not self._poll.poll(50):
                if self._stop.is_set():
                    return False
            n = os.readv(self._fd, [view])
            if n == 0:
                return False
            view = view[n:]
        return True

    def _answer(self, request: dict[str, Any], arrived: float) -> None:
        """Answer one request on the worker's stdin (a worker that stopped reading gets none)."""
        self.requests += 1
        if self.responder is None or self.answer_fd is None:
            answer: dict[str, Any] = {"refused": "this job takes no requests"}
        else:
            try:
                answer = self.responder(request, arrived)
            except Exception as e:  # noqa: BLE001 - a responder bug must not hang the worker
                answer = {"refused": f"the evaluator could not answer: {type(e).__name__}: {e}"}
        if self.answer_fd is not None:
            try:
                write_all(self.answer_fd, (json.dumps(answer) + "\n").encode())
            except OSError:
                pass

    def _resolve(self, fut: asyncio.Future[Any], value: Any) -> None:
        def set_() -> None:
            if not fut.done():
                fut.set_result(value)

        try:
            self._loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the loop has closed (sandbox shut down)
            pass

    def _run(self) -> None:
        try:
            first = read_frame(self._read_into, 0)
            ok = first is not None and first[0].get("type") == "ready"
            if ok:
                steps = first[0].get("startup_s")
                self.startup_s = {str(k): float(v) for k, v in (steps if isinstance(steps, dict) else {}).items()
                                  if isinstance(v, (int, float))}
                self.startup_s["wall"] = time.perf_counter() - self._started
            self._resolve(self.ready, ok)
            while ok:
                frame = read_frame(self._read_into, self._budget)
                arrived = time.perf_counter()
                if frame is None:
                    break
                self._budget -= len(frame[1])
                kind = frame[0].get("type")
                if kind == "request":
                    self._answer(frame[0], arrived)
                    continue
                self.frames.append(frame)
                if kind == "final":
                    self._resolve(self.final_seen, None)
        except FrameError as e:
            if "truncated" not in str(e):  # a worker that died mid-frame has no result: a crash
                self.error = f"malformed result channel: {e}"
        except OSError as e:
            self.error = f"result channel: {e}"
        finally:
            self._resolve(self.ready, False)
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._resolve(self.done, None)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def result_memory(capacity: int) -> int:
    """A sealed memfd of fixed capacity (sparse: only what is written takes memory)."""
    import fcntl

    fd = os.memfd_create("cudagym-results", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, capacity)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def _map_results(shm_fd: int, frames: list[tuple[dict[str, Any], memoryview]]) -> list[tuple[dict[str, Any], memoryview]]:
    """Tensor frames with their bytes: from the pipe, or from the worker's result memory."""
    cap = os.fstat(shm_fd).st_size
    spans = []
    for h, _ in frames:
        if h.get("type") == "tensor" and "offset" in h:
            off, n = h.get("offset"), h.get("nbytes")
            if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 < n and off + n <= cap):
                raise FrameError(f"a tensor frame names bytes outside the result memory ({off!r}, {n!r})")
            spans.append(off + n)
    # read-only (the worker is dead: the bytes are final) and populated: no fault per 4 KB page
    mm = mmap.mmap(shm_fd, max(spans), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                   prot=mmap.PROT_READ) if spans else None
    view = memoryview(mm) if mm is not None else None
    out = []
    for h, payload in frames:
        if h.get("type") == "tensor" and "offset" in h and view is not None:
            payload = view[h["offset"] : h["offset"] + h["nbytes"]]
        out.append((h, payload))
    return out


def collect_outcome(frames: FrameReader, shm_fd: int, nonce: str, outcome: JobOutcome,
                    release: Callable[[], None]) -> None:
    """Fill `outcome` from a finished worker's frames and result memory (checked: a malformed or
    forged channel is a `channel_error`); `release()` frees the worker's descriptors after."""
    try:
        if frames.error:
            outcome.channel_error = frames.error
            return
        try:
            received = _map_results(shm_fd, frames.frames)
        except FrameError as e:
            outcome.channel_error = f"malformed result channel: {e}"
            return
    finally:
        release()
    finals = [h for h, _ in received if h.get("type") == "final"]
    for h, payload in received:
        t = h.get("type")
        if t == "started":
            outcome.started = h
        elif t == "tensor":
            outcome.tensors.append((h, payload))
        elif t != "final":
            outcome.channel_error = f"unexpected frame type {t!r} on the result channel"
    if len(finals) > 1:
        outcome.channel_error = "more than one result on the result channel"
    elif finals:
        if finals[0].get("nonce") != nonce:
            outcome.channel_error = "a result without the job's nonce (forged)"
        else:
            outcome.final = finals[0]
            phases = finals[0].get("phases")
            outcome.phases = {str(k): float(v) for k, v in (phases if isinstance(phases, dict) else {}).items()
                              if isinstance(v, (int, float))}
    outcome.phases.update({f"startup_{k}": v for k, v in frames.startup_s.items()})
