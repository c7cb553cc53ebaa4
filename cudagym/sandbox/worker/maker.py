"""The inputs of a CPU timing job's calls, made outside the candidate's process.

Each timed call's inputs come from a seed the parent draws for that call. Made in the worker,
the seed and the inputs sit in the candidate's process from the parent's answer to the call's
interval: any read of the harness's there that the candidate's code hijacked (a one-shot hook
that puts itself back, a finalizer) can compute the next output from them, untimed, and the
call then returns it. Every check between calls closes one such route; none closes the class.

So the candidate's inputs in a CPU timing job are made by a second process, the maker, forked
from the worker as it starts (`fork_early`: before any OpenMP parallel region, after which a
forked child's first region never returns). It holds the parent's two pipes, whose copies the
worker closes at once, and the task's input generator, which it sets up itself from the job the
worker hands it before any candidate code loads (`attach`); it takes no ptrace and no /proc
access from the worker (not dumpable) and dies with it. The call's input buffers are memory the
two processes share. The parent's answer to the worker's request for a call carries no seed; the
worker flushes the caches and writes the call's "forward" mark; the parent, once it has the
mark, writes the seed to the maker, which writes the inputs into the call's buffers and says so,
and only then lets the worker go on (`cudagym.sandbox.makerlink`). The inputs exist in the
candidate's process only inside the call's window on the parent's clock: what reads them before
the interval opens runs there, sampled, and the window is held to the call's reported interval
(`checks.cpu_windows_tight`). A candidate that writes into the buffers only changes its own
inputs: its outputs are checked against the reference's on the parent's seed.

Spawned workers get the pipes as two more descriptors; a container's worker (its channel is a
directory) and Nsight Compute's get none, and make their inputs themselves as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cudagym.sandbox.worker.state import WorkerState

READY, MADE = b"ready %d\n", b"made\n"  # the first with the input sets' count
_HELLO = struct.Struct("<QQ")  # the maker's first word to the worker: one set's bytes, the sets
_ALIGN = 64
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4


@dataclass
class Maker:
    """The worker's end: the maker's process (it dies with the worker) and the timed loop's input
    sets, views of the memory the maker writes each call's inputs into (an input that is not a
    tensor is the template's, fixed)."""

    pid: int
    sets: list[list[Any]]
    memory: mmap.mmap

    def inputs(self, _seed: int = 0) -> list[Any]:
        """Nothing for the loop to copy (`drive_calls`' `inputs_for`): the maker writes the buffers."""
        return []


# per input: where its storage lies in a set (offset, bytes), and its dtype, shape, stride and offset
Spot = tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _layout(template: list[Any]) -> tuple[list[Spot | None], int]:
    """Where each tensor input of one set lies in the shared memory, and the set's size: each
    keeps the template's strides and storage offset (a task may hand forward a transposed view)."""
    at, out = 0, list[Spot | None]()
    for a in template:
        if not isinstance(a, torch.Tensor):
            out.append(None)
            continue
        if a.device.type != "cpu":
            raise ValueError("the inputs maker serves the CPU target only")
        nbytes = a.untyped_storage().nbytes()
        out.append((at, nbytes, a.dtype, tuple(a.shape), tuple(a.stride()), int(a.storage_offset())))
        at += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return out, max(at, _ALIGN)


def _views(memory: mmap.mmap, template: list[Any], k: int) -> list[list[Any]]:
    """`k` input sets shaped as `template` over `memory` (its tensors views of it)."""
    layout, size = _layout(template)
    sets = []
    for j in range(k):
        views: list[Any] = []
        for a, spot in zip(template, layout, strict=True):
            if spot is None:
                views.append(a)
                continue
            at, nbytes, dtype, shape, stride, offset = spot
            raw = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=j * size + at) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            views.append(raw.view(dtype).as_strided(shape, stride, offset))
        sets.append(views)
    return sets


def fork_early(fds: tuple[int, int], state: WorkerState) -> tuple[int, int]:
    """Fork the maker as the worker starts (no OpenMP region has run yet); the worker's copies of
    the parent's pipes `fds` (seeds, made) are closed here. Returns the maker's pid and the
    worker's end of the socket it hands the maker the job on (`attach`; closing it ends the
    maker)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mine.close()
            _serve(fds, theirs.detach(), state)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    for fd in fds:
        os.close(fd)
    return pid, mine.detach()


def attach(link: tuple[int, int], job_line: bytes, template: list[Any], k: int) -> Maker:
    """Hand the maker the job (its own line, as the worker read it) and map the `k` input sets it
    made for it, each shaped as `template` (the worker's own first inputs; the maker makes its
    own from the same task and must agree). Call before any candidate code loads."""
    pid, sock = link
    _, size = _layout(template)
    with socket.socket(fileno=sock) as s:
        s.sendall(job_line + b"\n")
        msg, fds, _, _ = socket.recv_fds(s, _HELLO.size, 1)
    if len(msg) != _HELLO.size or len(fds) != 1:
        raise RuntimeError(f"the inputs maker did not set up the job's inputs ({msg!r})")
    got = _HELLO.unpack(msg)
    try:
        if got != (size, k):
            raise RuntimeError(f"the inputs maker laid out {got[1]} input sets of {got[0]} bytes, the worker "
                               f"{k} of {size}")
        memory = mmap.mmap(fds[0], size * k)
    finally:
        os.close(fds[0])
    return Maker(pid, _views(memory, template, k), memory)


def _serve(fds: tuple[int, int], sock: int, state: WorkerState) -> None:
    """The maker's life: the job from the worker, its input sets in memory shared with the
    worker; then, for each "SEED SET" line the parent writes, that seed's inputs into that set's
    buffers and "made", until the parent closes its pipe."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the worker's main thread
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/<pid>/mem or fd from the worker
    seeds, made = fds
    for name in os.listdir("/proc/self/fd"):  # the worker's channel and stdin are the worker's
        fd = int(name)
        if fd not in (seeds, made, sock, 2):
            try:
                os.close(fd)
            except OSError:
                pass
    # one thread: an OpenMP pool's workers spin for milliseconds after each region, into the call,
    # on the cores the candidate's threads need (its own OpenMP kernel read 5-6 ms a call instead
    # of 3 beside them); the inputs' draws are sequential anyway
    torch.set_num_threads(1)
    with socket.socket(fileno=sock) as s:
        line = s.makefile("rb").readline()
        if not line:  # the worker's job is not a CPU timing job
            return
        from cudagym.sandbox.worker.problem import Problem
        from cudagym.sandbox.worker.wire import Job

        job = Job.model_validate_json(line)
        p = Problem(job, state, with_candidate=False)
        template = p.inputs(0)
        from cudagym.sandbox.worker.timed import input_sets

        k = input_sets(job, template)
        _, size = _layout(template)
        memfd = os.memfd_create("cudagym-inputs", os.MFD_CLOEXEC)  # no file-size limit here (the job's is not set)
        os.ftruncate(memfd, size * k)
        sets = _views(mmap.mmap(memfd, size * k), template, k)
        for views in sets:  # each set starts as the template (the loop's first call of it is written over)
            for view, a in zip(views, template, strict=True):
                if isinstance(a, torch.Tensor):
                    view.copy_(a)
        socket.send_fds(s, [_HELLO.pack(size, k)], [memfd])
        os.close(memfd)
    with socket.socket(fileno=os.dup(made)) as s:  # with its credentials: the parent learns its pid
        s.sendmsg([READY % k], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                                 struct.pack("3i", os.getpid(), os.getuid(), os.getgid()))])
    reader = os.fdopen(seeds, "rb", buffering=0)
    while line := reader.readline():
        seed, slot = (int(v) for v in line.split())
        for view, a in zip(sets[slot % k], p.inputs(seed), strict=True):
            if isinstance(a, torch.Tensor):
                view.copy_(a)
        os.write(made, MADE)
