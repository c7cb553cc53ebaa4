"""A worker process's life: `python -m cudagym.sandbox.worker RESULT_FD [SHM_FD [SEEDS_FD MADE_FD]]`, or
`python -m cudagym.sandbox.worker --channel DIR` where descriptors cannot be inherited (a container).

A worker is started ahead of need (a spare): it imports torch and the harness (`warm_host`) and,
on a GPU, creates its CUDA context (`serve`), then blocks until the parent writes one `Job`
line on stdin. (A fork server, `cudagym.sandbox.forkserver`, runs `warm_host` once and forks
workers that start at `serve` with its `WorkerState`.) The worker applies the job's limits
(writes confined to the workspace, file size, address space), runs the job, writes frames on
RESULT_FD (tensor bytes into the memfd SHM_FD) and exits. SEEDS_FD and MADE_FD are the pipes of a
CPU timing job's inputs maker (`cudagym.sandbox.worker.maker`). One job per process: nothing survives
into the next job.

Imports no torch at its top: `warm_host` times torch's import and the harness's apart.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cudagym.sandbox.worker.state import WorkerState
    from cudagym.sandbox.worker.wire import Job


def _uses_cpp_extension(workspace: str) -> bool:
    try:
        return "cpp_extension" in (Path(workspace) / "model_new.py").read_text(errors="replace")
    except OSError:
        return False


MAX_ERROR_CHARS = 3000


def raised_by_candidate(exc: BaseException, roots: list[str], depth: int = 0) -> bool:
    """Whether the candidate's code is on the exception's path (a frame of its files, or of
    the code it ran): then the exception is the candidate's, whatever harness code it passed."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith("<candidate") or any(name.startswith(r) for r in roots):
            return True
        tb = tb.tb_next
    cause = exc.__cause__ or exc.__context__
    return cause is not None and depth < 8 and raised_by_candidate(cause, roots, depth + 1)


def pin_cpus(cpus: str | None) -> None:
    """Restrict the calling thread (and threads it starts later) to `cpus` ("3" or "0,1,2")."""
    if cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):
            pass


def open_channel(directory: str) -> tuple[int, int]:
    """The channel files the parent made in `directory` (the docker backend): the FIFO `frames`
    (the result pipe), the file `results` (result memory) and the FIFO `answers`, which becomes
    stdin. `answers` is opened read-write so that it never reads end-of-file before the parent
    has opened it; the parent holds `frames` open for reading before the worker starts."""
    stdin = os.open(os.path.join(directory, "answers"), os.O_RDWR)
    os.dup2(stdin, 0)
    os.close(stdin)
    fd = os.open(os.path.join(directory, "frames"), os.O_WRONLY)
    return fd, os.open(os.path.join(directory, "results"), os.O_RDWR)


def main() -> None:
    if not os.environ.get("CUDAGYM_UNDER_NCU"):  # ncu's counters may be kept for privileged processes
        from cudagym.sandbox.limits import drop_privileges

        drop_privileges()  # one thread yet: every thread torch starts inherits it
    if sys.argv[1] == "--channel":
        fd, shm = open_channel(sys.argv[2])
        shm_fd: int | None = shm
    else:
        fd = int(sys.argv[1])
        shm_fd = int(sys.argv[2]) if len(sys.argv) > 2 else None
    pin_cpus(os.environ.get("CUDAGYM_CPUS"))  # before torch starts its threads: they inherit it
    clock = StartupClock()
    state = warm_host(clock)
    if len(sys.argv) > 4:
        state.maker_fds = (int(sys.argv[3]), int(sys.argv[4]))
    serve(fd, shm_fd, clock, state)


class StartupClock:
    """Seconds of each start-up step, on the worker's own clock (sent with the ready frame)."""

    def __init__(self, steps: dict[str, float] | None = None) -> None:
        self.steps: dict[str, float] = dict(steps or {})
        self._t = time.perf_counter()

    def step(self, name: str) -> None:
        now = time.perf_counter()
        self.steps[name], self._t = now - self._t, now


def warm_host(clock: StartupClock) -> WorkerState:
    """The start-up that touches no GPU driver: import torch and the harness, and the harness's
    host-side prewarm, which makes the worker's state. A fork server does this once and forks
    its workers after it."""
    import torch  # noqa: F401

    clock.step("import_torch")
    from cudagym.sandbox.worker import prewarm

    clock.step("import_harness")
    state = prewarm.prewarm_host()
    clock.step("prewarm")
    return state


def _writable(job: Job) -> list[str]:
    """Where the job's worker may write: its workspace and scratch. An ncu job's outer worker,
    which runs only Nsight Compute over a child worker and no candidate code, may also write under
    /proc: ncu's injected library writes there while CUDA starts in the child, which inherits
    this domain (under a domain without /proc, its cudaGetDeviceCount failed with error 304). The
    child adds its own domain, without /proc, after its CUDA start-up and before any candidate
    code, as every worker does; Landlock layers stack, so the candidate's writes answer to both,
    and ncu's own writes (its log, through a link the candidate may have planted in the
    workspace) stay inside the workspace."""
    from cudagym.sandbox.ncu import UNDER_NCU

    dirs = [d for d in [job.workspace, *job.writable] if d]
    return [*dirs, "/proc"] if job.kind == "ncu" and not os.environ.get(UNDER_NCU) else dirs


def serve(fd: int, shm_fd: int | None, clock: StartupClock, state: WorkerState) -> None:
    """The rest of a worker's life: its device's start-up (the CUDA context, the profiler, the
    result memory), the ready frame, then one job; never returns."""
    import torch

    from cudagym.sandbox.jit import jit_cache_env, workspace_scratch
    from cudagym.sandbox.limits import apply_rlimits, restrict_writes
    from cudagym.sandbox.worker.failures import CandidateError, candidate_traceback
    from cudagym.sandbox.worker.jobs import JOBS
    from cudagym.sandbox.worker.integrity import channel_parts
    from cudagym.sandbox.worker.prewarm import premap_results, prewarm_device
    from cudagym.sandbox.worker.wire import Channel, Job, encode_frame

    if state.maker_fds is not None and os.environ.get("CUDAGYM_DEVICE") != "cuda":
        from cudagym.sandbox.worker.maker import fork_early

        state.maker = fork_early(state.maker_fds, state)  # first: no OpenMP region has run in this process
        state.maker_fds = None
        clock.step("fork_maker")
    elif state.maker_fds is not None:  # a GPU's worker makes its inputs itself
        for maker_fd in state.maker_fds:
            os.close(maker_fd)
        state.maker_fds = None
    if os.environ.get("CUDAGYM_DEVICE") == "cuda":
        torch.empty(1, device="cuda")  # create the CUDA context while idle
        clock.step("cuda_context")
    prewarm_device(state)
    clock.step("prewarm_device")
    if shm_fd is not None:
        state.premapped = premap_results(shm_fd, int(os.environ.get("CUDAGYM_PREMAP_MB", "0") or 0))
        clock.step("premap")
    os.write(fd, encode_frame({"type": "ready", "startup_s": clock.steps}))  # the parent starts the job's clock now

    line = state.stdin.readline()  # the parent's later answers arrive on the same stdin
    if not line:
        os._exit(0)
    job = Job.model_validate_json(line)
    state.job_line = line.strip()
    if state.maker is not None and not (job.inputs_maker and job.kind == "profile" and job.device == "cpu"):
        os.close(state.maker[1])  # the maker exits: this job makes its inputs itself
        state.maker = None
    ch = Channel(fd, job.nonce, state.stdin, shm_fd, state.premapped)
    state.channel, state.channel_parts = ch, channel_parts(ch)
    try:
        scratch = job.workspace or (job.writable[0] if job.writable else "")
        if scratch:
            os.makedirs(scratch, exist_ok=True)
            os.chdir(scratch)
            tmp = str(workspace_scratch(scratch)) if job.workspace else os.path.join(scratch, "tmp")
            os.makedirs(tmp, exist_ok=True)
            os.environ["TMPDIR"] = tmp
            tempfile.tempdir = tmp  # gettempdir() may have been cached before
            # JIT caches (torch.compile, Triton, CuPy) inside what the job may write: HOME is read-only.
            # A workspace job's are where the parent reads them after the job (`cudagym.sandbox.jit`).
            os.environ.update(jit_cache_env(scratch if job.kind == "baseline" else tmp))
        landlocked = restrict_writes(_writable(job))
        apply_rlimits(max_file_mb=job.limits.max_file_mb,
                      memory_mb=job.limits.memory_mb if job.device == "cpu" else None)
        ch.send({"type": "started", "landlock": landlocked})
        if job.kind in ("verify", "profile", "ncu") and _uses_cpp_extension(job.workspace):
            from cudagym.sandbox.inline import install_inline_loader

            install_inline_loader(Path(job.cache_dir), Path(job.workspace))  # loads pre-built modules, never builds
        JOBS[job.kind](job, ch, state)
    except CandidateError as e:
        ch.final({"ok": False, "kind": e.kind, "error": str(e)})
    except MemoryError:
        ch.final({"ok": False, "kind": "memory_limit", "error": "the job ran out of its memory limit"})
    except BaseException as e:  # noqa: BLE001 - report, never hang
        msg = f"{type(e).__name__}: {e}"
        roots = [r for r in (job.workspace, job.artifact_dir) if r]
        if "can't allocate memory" in msg or "out of memory" in msg:
            kind = "memory_limit"
        elif "CUDA error" in msg or "illegal memory access" in msg or "device-side assert" in msg:
            kind = "crash"  # the candidate's kernel broke the CUDA context
        elif raised_by_candidate(e, roots):
            kind, msg = "exception", candidate_traceback(e, roots)
        elif state is not None and state.candidate_ran and job.kind == "profile":
            # the harness broke once candidate code had run: not a failure the candidate is spared
            # (red team 14's d: an op name with tabs broke the op counts' parse, and the +1 of an
            # unavailable profile stood without the timed calls' audits)
            kind, msg = "tamper", f"the harness failed after the candidate's code had run: {msg}"
        else:
            kind = "internal"
        ch.final({"ok": False, "kind": kind, "error": msg[-MAX_ERROR_CHARS:]})
    sys.stdout.flush()
    sys.stderr.flush()
    if job.kind in ("verify", "profile"):  # alive until killed: the sandbox reads what it has mapped
        state.stdin.readline()  # executable once the result is in (`cudagym.sandbox.maps`)
    os._exit(0)

