"""The parent's end of a CPU timing job's inputs maker (`cudagym.sandbox.worker.maker`).

`MakerLink` wraps the job's responder: the seed of each answer to a timed call's request is kept
here and the worker gets the answer without it; once the worker's "forward" mark for that call
arrives (`opened`, run before the mark is acknowledged), the maker writes the call's inputs into
its buffers, and the acknowledgement goes only after it said so, written while the worker's
processes are still stopped (`acked` lets them go on: the worker finds its answer waiting, and
the call's time on this process's clock runs from that moment, `resumed_s`). A maker that is
gone or does not answer in time fails the call. The maker's first line carries its credentials
(its pid as the kernel gives it to this process): its samples (`cudagym.sandbox.cpusamples`) are
the harness's.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import time
from typing import Any

from cudagym.sandbox.cpusamples import run_queue_ns
from cudagym.sandbox.worker.wire import Responder

MADE = b"made\n"
_UCRED = struct.Struct("3i")  # pid, uid, gid


class MakerLink:
    """A responder (`Responder`) that keeps each timed call's seed from the worker and has its
    inputs maker make the call's inputs once the call's mark is in (`opened`). `seeds`, `made`:
    the parent's ends of the maker's pipes (the caller keeps and closes them; `made` is a Unix
    socket that passes credentials: `answering_socket`)."""

    def __init__(self, inner: Responder, seeds: int, made: int, timeout_s: float,
                 pids: list[int] | None = None) -> None:
        self.inner, self.seeds, self.made, self.timeout_s = inner, seeds, made, timeout_s
        self.root = pids[0] if pids else None  # the worker's tree, stopped while the maker writes
        # whose waits for a CPU each call's `waited_s` sums: this thread (the frames reader, which
        # runs the responder and `opened`) and the main thread of each of the worker's processes
        self._waits = ["/proc/thread-self/schedstat", *(f"/proc/{pid}/schedstat" for pid in pids or [])]
        self._waits_from: int | None = None
        self.waited_s: list[float] = []  # of each timed call, from its request to its "returned" mark
        self.sets = 0  # the input sets the maker writes, once it said it is ready
        self.pid: int | None = None  # the maker's, as this process sees it, once it said it is ready
        self.pending: tuple[int, int] | None = None  # the next call's seed and input set
        # when each timed call's worker went on (this process's clock, right before its SIGCONT, its
        # answer already written): nothing of the call's ran before (`stop_tree`)
        self.resumed_s: list[float] = []
        self._held: list[int] | None = None  # the worker's processes stopped for the pending mark
        self.error: str | None = None

    def __call__(self, request: dict[str, Any], arrived_s: float) -> dict[str, Any]:
        answer = self.inner(request, arrived_s)
        if request.get("what") != "call" or "seed" not in answer:
            return answer
        if self.error is None and not self.sets:
            try:
                self._ready()
            except (OSError, TimeoutError, ValueError) as e:
                self.error = f"the harness's inputs maker failed: {e}"
        if self.error is not None:
            return {"refused": self.error}
        index = request.get("index")
        slot = index % self.sets if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else 0
        self.pending = (int(answer.pop("seed")), slot)
        self._waits_from = run_queue_ns(self._waits)
        return {**answer, "made": False}

    def opened(self, what: str) -> dict[str, Any] | None:
        """Before the worker's mark `what` is acknowledged: for the call's "forward" mark, the
        worker's processes are stopped and the maker makes the call's inputs; a refusal to
        acknowledge with if it fails. `acked` lets them go on."""
        if what == "returned" and self._waits_from is not None:
            self.waited_s.append((run_queue_ns(self._waits) - self._waits_from) / 1e9)
            self._waits_from = None
        if what != "forward" or self.pending is None:
            return None
        (seed, slot), self.pending = self.pending, None
        self._held = stopped = []
        try:
            # every process of the worker's but the maker stopped while the maker writes: the time
            # is left out of the call's window (`made_in_windows`), and red team 28's a15 used it, two
            # threads chasing the maker's writes row by row and computing the outputs before the
            # call began
            stopped += stop_tree(self.root, keep=self.pid, timeout_s=self.timeout_s)
            os.write(self.seeds, f"{seed} {slot}\n".encode())
            got = self._line(len(MADE), "make the call's inputs")
            if got != MADE:
                raise ValueError(f"it answered {got!r}")
        except (OSError, TimeoutError, ValueError) as e:
            self.error = f"the harness's inputs maker failed: {e}"
            return {"refused": self.error}
        return None

    def acked(self, what: str) -> None:
        """Once the worker's mark `what` is acknowledged (or could not be): the processes
        `opened` stopped go on, and a "forward" mark's call is timed from now (`resumed_s`). The
        acknowledgement waits on the pipe for the worker, so what the call's window holds of the
        hand-over (`made_in_windows`) is the worker's waking, none of this process's steps."""
        if what != "forward" or self._held is None:
            return
        stopped, self._held = self._held, None
        self.resumed_s.append(time.perf_counter())
        _continue(stopped)

    def _ready(self) -> None:
        """Read the maker's first line ("ready SETS") and the credentials it came with."""
        if not select.select([self.made], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"it did not start within {self.timeout_s:.0f} s")
        with socket.socket(fileno=os.dup(self.made)) as s:
            data, ancillary, _, _ = s.recvmsg(64, socket.CMSG_SPACE(_UCRED.size))
        words = data.split()
        if len(words) != 2 or words[0] != b"ready" or not data.endswith(b"\n") or not words[1].isdigit() \
                or int(words[1]) < 1:
            raise ValueError(f"it started with {data!r}")
        for level, kind, body in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(body) >= _UCRED.size:
                self.pid = _UCRED.unpack_from(body)[0]
        self.sets = int(words[1])

    def _line(self, size: int, what: str) -> bytes:
        """Read up to a newline, at most `size` bytes, within the timeout."""
        got = b""
        deadline = time.monotonic() + self.timeout_s
        while not got.endswith(b"\n") and len(got) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.made], [], [], left)[0]:
                raise TimeoutError(f"it did not {what} within {self.timeout_s:.0f} s")
            chunk = os.read(self.made, size - len(got))
            if not chunk:
                raise ValueError(f"it exited before it could {what}")
            got += chunk
        return got


def made_in_windows(windows: list[tuple[float, float]], resumed_s: list[float]) -> list[int]:
    """Each timed call's time (µs) from its window's open (`cpusamples.windows_from_marks`) to
    the worker's resume (`MakerLink.resumed_s`, one per call, in order): the harness's part of the
    window, which `checks.cpu_windows_tight` leaves out; bounded by the window. A call without a
    resume (counts that differ) gets none of it."""
    if len(resumed_s) != len(windows):
        return [0] * len(windows)
    return [round(min(max(r - a, 0.0), b - a) * 1e6) for (a, b), r in zip(windows, resumed_s, strict=True)]


def _per_thread(pid: int, name: str) -> list[bytes] | None:
    """`/proc/PID/task/TID/NAME` of each thread of `pid` (a thread gone meanwhile left out);
    None if `pid` is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: list[bytes] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}", "rb") as f:
                out.append(f.read())
        except OSError:
            continue
    return out


def _children(pid: int) -> list[int]:
    """`pid`'s child processes, from each of its threads' `children` list (Linux 3.5+)."""
    return [int(c) for text in _per_thread(pid, "children") or [] for c in text.split() if c.isdigit()]


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (state T or t), or gone."""
    for stat in _per_thread(pid, "stat") or []:
        fields = stat.rsplit(b")", 1)[-1].split()
        if fields and fields[0] not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def _continue(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def stop_tree(root: int | None, keep: int | None, timeout_s: float) -> list[int]:
    """SIGSTOP `root` and every process below it but `keep` (and what `keep` started), and wait
    until each of their threads is stopped; the pids stopped (the caller sends SIGCONT). A
    process forked meanwhile is found by a second sweep. TimeoutError if they are not stopped
    within `timeout_s`."""
    if root is None:
        return []
    stopped: list[int] = []
    for _ in range(2):
        todo = [root]
        while todo:
            pid = todo.pop()
            if pid == keep:
                continue
            if pid not in stopped:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    continue
                stopped.append(pid)
            todo += _children(pid)
    deadline = time.monotonic() + timeout_s
    for pid in stopped:
        while not _stopped(pid):
            if time.monotonic() > deadline:
                _continue(stopped)
                raise TimeoutError(f"the worker's process {pid} did not stop within {timeout_s:.0f} s")
            time.sleep(0)
    return stopped


def answering_socket() -> tuple[int, int]:
    """The maker's answering channel: (the parent's end, the maker's), a Unix socket pair whose
    parent's end receives the maker's credentials."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    return mine.detach(), theirs.detach()
