"""The local sandbox: fresh worker processes on this host, started ahead of need.

Starting Python, importing torch and creating a CUDA context costs seconds, so the sandbox
keeps spare workers that have already paid for it and wait for one job each; after the job the
worker exits and a new spare takes its place. Each job therefore still gets a fresh process.
Workers are forked from a warm fork server per device (`cudagym.sandbox.forkserver`), which
has paid for Python, torch and the harness once; where it cannot start, or could not keep
CUDA usable across a fork, each worker is spawned instead.

Subprocesses live on one private event-loop thread, so callers on any loop (or none) can use
the sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

import cudagym
from cudagym.errors import SandboxError
from cudagym.sandbox.worker.wire import JobOutcome, Responder
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.forkserver import ForkedWorker, ForkServer, unshare_flags
from cudagym.sandbox.gpu import foreign_gpu_use, gpu_local_cpus
from cudagym.sandbox.limits import JobCgroup, landlock_abi, namespace_prefix, parent_death_prefix
from cudagym.sandbox.cpusamples import (
    CpuSampler, attribute, call_bounds, candidate_loaded_at, read_maps, thread_cpu_ns, windows_from_marks,
)
from cudagym.sandbox.makerlink import MakerLink, answering_socket, made_in_windows
from cudagym.sandbox.maps import exec_mappings, unbuilt
from cudagym.sandbox.opwatch import build_library
from cudagym.sandbox.schedule import JobLease, RunningJob, SpareWorkerSandbox
from cudagym.sandbox.worker.wire import TIMING_KINDS, FrameReader, Job, collect_outcome, result_memory, write_all

log = logging.getLogger(__name__)
_OUTPUT_LIMIT = 20_000
_CODE_READ_KINDS = ("verify", "profile")  # jobs that run the candidate's code and report unbuilt code
_NICE = shutil.which("nice")


class _ServerDiedError(SandboxError):
    """The fork server died while it was asked for a worker."""


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process | ForkedWorker
    frames: FrameReader  # reading the result pipe since the worker started
    shm_fd: int  # the worker's result memory (a sealed memfd), mapped once the worker is gone
    device: str
    stdin_fd: int  # the job line, then the answers to the worker's requests
    # the parent's ends of the worker's inputs maker's pipes (seeds, written; made, read), where it
    # has them (`cudagym.sandbox.makerlink`)
    maker: tuple[int, int] | None = None
    waiter: bool = False  # `proc` only waits for the worker, its child (the init of its PID namespace)
    # a GPU timing job's check for other processes on its device, made before it asked for the
    # lease (`LocalSandbox._before_lease`): why it is refused (or None), since when (NVML's sample
    # clock, µs) the check after the job looks, and what it saw (where sharing is only reported)
    device_check: tuple[str | None, int, str | None] | None = None

    def close_pipes(self) -> None:
        """Release the worker's stdout pipe, on the sandbox's loop (once it has exited)."""
        if isinstance(self.proc, ForkedWorker):
            self.proc.close()
        else:
            self.proc._transport.close()  # type: ignore[attr-defined]  # noqa: SLF001 - asyncio's pipe transport

    def release(self) -> None:
        self.frames.stop()
        for fd in (self.shm_fd, self.stdin_fd, *(self.maker or ())):
            try:
                os.close(fd)
            except OSError:
                pass


class LocalSandbox(SpareWorkerSandbox):
    config: LocalSandboxConfig

    def __init__(self, config: LocalSandboxConfig | None = None, home: Path | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.home = Path(home or Path.home() / ".cache" / "cudagym" / "home")
        self.home.mkdir(parents=True, exist_ok=True)
        # The harness's op counter, built here (trusted) once per machine, loaded read-only by workers
        self.opwatch_dir = Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home() / ".cache" / "cudagym")
        build_library(self.opwatch_dir)
        self._prefix = namespace_prefix() if self.config.isolate else ()
        self._unshare = unshare_flags(self._prefix)  # the same namespaces, for forked workers
        self._spares: dict[str, list[_Worker]] = {}
        self._fork_servers: dict[str, ForkServer | None] = {}  # None: spawn (it could not start)
        self._fork_server_lock: asyncio.Lock | None = None
        self._reaping: set[asyncio.Future[None]] = set()  # killed workers not yet cleaned up
        self._running: list[RunningJob] = []  # checks running now (what timing jobs fence off)
        self._start_loop("cudagym-sandbox")

    @property
    def isolation(self) -> dict[str, bool]:
        return {
            "network_namespace": "--net" in self._prefix,
            "pid_namespace": "--pid" in self._prefix,
            "landlock": landlock_abi() > 0,
        }

    async def _stop_spares(self) -> None:
        if self._reaping:  # the last jobs' workers, killed: their exits come from the fork server
            await asyncio.wait(list(self._reaping), timeout=5)
        for workers in self._spares.values():
            for w in workers:
                self._kill(w)
                await w.proc.wait()
                w.close_pipes()  # before the loop closes
                w.release()
        self._spares.clear()
        for server in self._fork_servers.values():
            if server is not None:
                await server.close()
        self._fork_servers.clear()

    # -- workers ----------------------------------------------------------------------------
    def _env(self, device: str) -> dict[str, str]:
        pkg_root = str(Path(cudagym.__file__).resolve().parent.parent)
        pypath = os.pathsep.join([pkg_root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(self.home),
            "PYTHONPATH": pypath,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "CUDAGYM_DEVICE": "cuda" if device.startswith("cuda") else "cpu",
            "CUDAGYM_OPWATCH_DIR": str(self.opwatch_dir),
        }
        for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_LIBRARY_PATH", "CUDA_HOME",
                  "TORCH_CUDA_ARCH_LIST",
                  "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            if k in os.environ:
                env[k] = os.environ[k]
        env["CUDA_VISIBLE_DEVICES"] = _visible_entry(device.split(":")[1]) if device.startswith("cuda:") else (
            "" if device == "cpu" else _visible_entry("0"))
        premap = self.config.premap_result_mb
        env["CUDAGYM_PREMAP_MB"] = str(premap if premap is not None else (512 if device.startswith("cuda") else 0))
        if device.startswith("cuda"):
            index = int(device.split(":")[1]) if ":" in device else 0
            cpus = gpu_local_cpus(index)
            if cpus:  # run near the GPU
                env["CUDAGYM_CPUS"] = ",".join(map(str, cpus))
        return env

    async def _fork_server(self, device: str) -> ForkServer | None:
        """The device's fork server, started on first use; None where workers are spawned."""
        if not self.config.fork_server:
            return None
        if self._fork_server_lock is None:
            self._fork_server_lock = asyncio.Lock()
        async with self._fork_server_lock:
            server = self._fork_servers.get(device)
            if server is not None and not server.alive:  # it died: start another
                await server.close()
                del self._fork_servers[device]
            if device not in self._fork_servers:
                server = ForkServer(self.config.python, self._env(device))
                try:
                    await server.start(self.config.start_timeout_s)
                except SandboxError as e:
                    log.warning("%s; spawning each worker instead", e)
                    server = None
                else:
                    if not server.fork_ok:
                        log.warning("the fork server's forks could not use CUDA; spawning each worker instead")
                        await server.close()
                        server = None
                self._fork_servers[device] = server
            return self._fork_servers[device]

    async def _spawn(self, device: str) -> _Worker:
        try:
            return await self._spawn_once(device)
        except _ServerDiedError:  # killed between our request and its answer: once more, from a new server
            return await self._spawn_once(device)

    async def _spawn_once(self, device: str) -> _Worker:
        asked = time.perf_counter()
        r, w = os.pipe()
        job_r, job_w = os.pipe()  # the worker's stdin: written from the frame reader's thread too
        shm = result_memory(self.config.max_result_mb << 20)
        (seeds_r, seeds_w), (made_r, made_w) = os.pipe(), answering_socket()  # the inputs maker's (`makerlink`)
        try:
            proc: asyncio.subprocess.Process | ForkedWorker | None = await self._forked(
                device, job_r, w, shm, (seeds_r, made_w))
            if proc is None:
                proc = await self._spawn_process(device, job_r, w, shm, (seeds_r, made_w))
        except (OSError, SandboxError) as e:
            for fd in (r, w, shm, job_r, job_w, seeds_r, seeds_w, made_r, made_w):
                os.close(fd)
            if isinstance(e, _ServerDiedError):
                raise
            raise SandboxError(f"could not start a worker: {e}") from e
        for fd in (w, job_r, seeds_r, made_w):
            os.close(fd)
        frames = FrameReader(r, asyncio.get_running_loop(), self.config.max_result_mb << 20, started=asked)
        return _Worker(proc, frames, shm, device, job_w, waiter="pid" in self._unshare, maker=(seeds_w, made_r))

    async def _forked(self, device: str, job_r: int, w: int, shm: int, maker: tuple[int, int]) -> ForkedWorker | None:
        """A worker forked by the device's fork server; None where workers are spawned."""
        server = await self._fork_server(device)
        if server is None:
            return None
        out_r, out_w = os.pipe()
        try:
            return await server.fork(job_r, out_w, w, shm, out_r, self.config.spare_nice, self._unshare, maker)
        except BaseException as e:
            os.close(out_r)
            if isinstance(e, SandboxError) and not server.alive:
                raise _ServerDiedError(str(e)) from e
            raise
        finally:
            os.close(out_w)

    async def _spawn_process(self, device: str, job_r: int, w: int, shm: int,
                             maker: tuple[int, int]) -> asyncio.subprocess.Process:
        """A worker started as its own process (`python -m cudagym.sandbox.worker`)."""
        # Spares start at a low CPU priority, so that starting them does not slow the jobs and
        # comparisons running meanwhile; a worker gets normal priority when it takes a job.
        nice = [_NICE, "-n", str(self.config.spare_nice)] if _NICE and self.config.spare_nice else []
        # the first process dies with the thread that starts it (the sandbox's), and with it the
        # PID namespace's init (`unshare --kill-child`), which takes every process in it
        cmd = [*parent_death_prefix(), *nice, *self._prefix, self.config.python, "-m", "cudagym.sandbox.worker",
               str(w), str(shm), *map(str, maker)]
        return await asyncio.create_subprocess_exec(
            *cmd, stdin=job_r, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, pass_fds=(w, shm, *maker), env=self._env(device), start_new_session=True,
        )

    async def _take(self, device: str, replenish: bool = True) -> _Worker:
        """A spare worker; new spares start now, or after the job when it is a timing job
        (starting Python and torch beside a timed loop would disturb its host-side timings)."""
        pool = self._spares.setdefault(device, [])
        while pool:
            w = pool.pop(0)
            if w.proc.returncode is None:
                if replenish:
                    asyncio.ensure_future(self._replenish(device))
                return w
            w.release()
        w = await self._spawn(device)
        if replenish:
            asyncio.ensure_future(self._replenish(device))
        return w

    def _pause(self, workers: list[_Worker], pause: bool) -> None:
        self._signal(workers, signal.SIGSTOP if pause else signal.SIGCONT)

    def _running_beside(self, device: str) -> list[RunningJob]:
        # a GPU's timing job has it alone (its lease): what shares its cores are the CPU target's
        # checks; a CPU timing job shares them with every check
        return [r for r in self._running if device == "cpu" or r.device in ("cpu", device)]

    def _pause_running(self, jobs: list[RunningJob], pause: bool) -> int:
        """Freeze (thaw) each job's cgroup, or, without a freezer, SIGSTOP (SIGCONT) each of its
        processes, whatever session it made: killing a process group would miss those."""
        frozen = 0
        for r in jobs:
            if pause == (r.frozen_since is not None):
                continue
            cgroup: JobCgroup | None = r.handle
            if cgroup is not None and cgroup.freeze(pause):
                frozen += len(cgroup.pids()) if pause else 0
            elif pause:
                r.stopped = []
                for _ in range(2):  # a second sweep for what forked during the first
                    for p in self._tree(r.worker.proc.pid):
                        try:
                            p.send_signal(signal.SIGSTOP)
                            r.stopped.append(p.pid)
                        except psutil.Error:
                            pass
                frozen += len(set(r.stopped))
            else:
                for pid in [*(r.stopped or []), *(p.pid for p in self._tree(r.worker.proc.pid))]:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
                r.stopped = None
            if pause:
                r.frozen_since = time.perf_counter()
            elif r.frozen_since is not None:
                r.frozen_total_s += time.perf_counter() - r.frozen_since
                r.frozen_since = None
        return frozen

    def _host_load(self, worker: _Worker | None) -> Any:
        if worker is None:
            return None
        tick = os.sysconf("SC_CLK_TCK")

        def load() -> tuple[float, float, float]:
            try:
                with open("/proc/stat") as f:
                    fields = [int(x) for x in f.readline().split()[1:]]
                host = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
            except (OSError, ValueError, IndexError):
                host = 0.0
            job = 0.0
            for p in self._tree(worker.proc.pid):
                try:
                    t = p.cpu_times()
                    job += t.user + t.system
                except psutil.Error:
                    pass
            me = os.times()
            return host, job, me.user + me.system

        return load

    def _is_starting(self, worker: _Worker) -> bool:
        return not worker.frames.ready.done() and worker.proc.returncode is None

    @staticmethod
    def _signal(workers: list[_Worker], sig: int) -> None:
        for w in workers:
            try:
                os.killpg(w.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill(self, w: _Worker) -> None:
        """SIGKILL the worker: below a waiter (the parent outside its PID namespace, which exits
        with its status), the worker alone, so that the waiter's exit, and the job's end
        (`_reap`, the GPU lease), come only once the worker has exited whole, its CUDA context
        torn down; the worker takes its namespace with it. Otherwise (or if it cannot be found)
        the worker's process group, which its first process leads (start_new_session).

        Not `w.proc.kill()`: Popen polls (waitpid) before it signals, and a worker reaped by that
        poll leaves asyncio's child watcher, the one reaper of workers, without its exit status
        ("Unknown child process pid N", returncode 255 for the worker).
        """
        if w.waiter:
            try:
                inner = psutil.Process(w.proc.pid).children()
            except psutil.Error:
                inner = []
            for p in inner:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            if inner:
                return
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _tree(pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    @staticmethod
    def _ours() -> set[int]:
        """Every sandbox process of this evaluator's (this sandbox's and any other's in this
        process: fork servers, workers, `ncu`'s workers) and all they started; not the
        evaluator's other children (a trainer's inference server disturbs a timing as much as
        a stranger does)."""
        children: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            children.setdefault(p.info["ppid"], []).append(p.pid)
        ours: set[int] = set()
        todo = [(pid, False) for pid in children.get(os.getpid(), [])]
        while todo:
            pid, inside = todo.pop()
            if not inside:
                try:
                    inside = "cudagym.sandbox." in " ".join(psutil.Process(pid).cmdline())
                except psutil.Error:
                    continue
            if inside:
                ours.add(pid)
            todo.extend((c, inside) for c in children.get(pid, []))
        return ours

    async def _device_check(self, device: str, since_us: int = 0, also_ours: set[int] | None = None) -> str | None:
        """What processes other than the sandboxes' (`_ours`, and `also_ours`: a job's killed
        worker) do on `device` (a GPU) now, or since `since_us`; None if nothing. The evaluator's
        own process may hold an idle context (a test, a trainer's), not run kernels."""
        index = int(device.split(":")[1]) if ":" in device else 0
        return await asyncio.to_thread(lambda: foreign_gpu_use(index, self._ours() | (also_ours or set()), since_us,
                                                               self.config.gpu_sharing_allow,
                                                               idle_ok=frozenset({os.getpid()})))

    async def _before_lease(self, job: Job, device: str, w: _Worker) -> None:
        """A GPU timing job: wait (up to `device_busy_wait_s`) until no other process is on its
        device, before it asks for the lease, so that a busy device holds no other job off;
        `_run_on` refuses the job if one stays, and checks NVML's samples from here on after it."""
        w.device_check = None
        if job.kind not in TIMING_KINDS or not device.startswith("cuda") or self.config.gpu_sharing == "allow":
            return
        refused = None
        waited = time.perf_counter()
        while (foreign := await self._device_check(device, int(time.time() * 1e6) - 1_000_000)) is not None \
                and self.config.gpu_sharing == "refuse":  # (its last second of utilization samples)
            if time.perf_counter() - waited >= self.config.device_busy_wait_s:
                refused = f"another process is on {device}: {foreign} (waited {time.perf_counter() - waited:.0f} s)"
                break
            await asyncio.sleep(1.0)
        w.device_check = refused, int(time.time() * 1e6), foreign  # NVML's sample clock: µs of the wall clock

    async def _ready(self, device: str) -> _Worker:
        """A spare of `device` that is ready (started spares start its replacement now; a
        timing job pauses them in its quiet windows); SandboxError if none starts."""
        for attempt in range(self.LOST_WORKER_RETRIES + 1):
            w = await self._take(device)
            died = True  # its pipe closed before the ready frame (not the start-up timeout)
            try:
                ready = await asyncio.wait_for(asyncio.shield(w.frames.ready), timeout=self.config.start_timeout_s)
            except asyncio.TimeoutError:
                ready = died = False
            except asyncio.CancelledError:
                self._spares.setdefault(device, []).insert(0, w)  # not used: it stays a spare
                raise
            if ready:
                return w
            self._kill(w)
            w.release()
            await w.proc.wait()
            if not died or attempt == self.LOST_WORKER_RETRIES:  # died: its fork server killed while it started?
                break
        raise SandboxError("a sandbox worker failed to start (python -m cudagym.sandbox.worker)")

    def _unused(self, w: _Worker) -> None:
        self._spares.setdefault(w.device, []).insert(0, w)

    async def _run_on(self, job: Job, device: str, responder: Responder | None,
                      w: _Worker) -> tuple[JobOutcome, asyncio.Future[None]]:
        """Run `job` in the ready worker `w`; returns the outcome as soon as the result is in (the
        worker is killed then) and a future that resolves once the worker has exited and been
        cleaned up."""
        timing = job.kind in TIMING_KINDS
        limits = job.limits
        frames = w.frames
        outcome = JobOutcome(final=None)
        t_ready = time.perf_counter()
        steps = _Steps(t_ready)  # the parent's own steps of the job (`JobOutcome.phases`, "parent_*")
        if self.config.spare_nice:
            try:  # every thread of the worker's process group back to normal priority
                os.setpriority(os.PRIO_PGRP, w.proc.pid, 0)
            except OSError:  # lowering niceness needs CAP_SYS_NICE: the job runs at the spare's
                pass
        cgroup = None
        if self.config.isolate:  # after start-up, so torch's own thread pools are counted in the base
            base_threads = sum(_num_threads(p) for p in self._tree(w.proc.pid))
            cgroup = JobCgroup(max_pids=base_threads + limits.max_processes,
                               memory_mb=limits.memory_mb + 2048 if job.device == "cpu" else None)
            for p in self._tree(w.proc.pid):
                cgroup.add(p.pid)
        steps.mark("cgroup")
        running = None
        if not timing:  # a check: frozen by the timing jobs' windows that share its cores
            running = RunningJob(w, device, cgroup)
            self._running.append(running)
            for qdevice, q in list(self._quiet.items()):
                if running in self._running_beside(qdevice):
                    q.started(running)
        # A GPU's timing job: no other process may use the device before or during it (checked
        # before the job asked for its lease: `_before_lease`)
        refused, foreign_since, foreign = w.device_check if w.device_check is not None else (None, 0, None)
        w.device_check = None
        outcome.device_busy = refused
        pids = [p.pid for p in self._tree(w.proc.pid)]  # the worker's processes (no job sent yet: no more)
        # what the worker maps executable, read from outside it, before any candidate code runs
        code_before = exec_mappings(pids) if job.kind in _CODE_READ_KINDS else None
        # where a CPU worker's time goes, sampled by the kernel out of its reach (`cudagym.sandbox.cpusamples`)
        sampler = (CpuSampler(pids,
                              self.config.cpu_sample_timed_us if job.kind == "profile" else self.config.cpu_sample_us)
                   if job.device == "cpu" and job.kind in _CODE_READ_KINDS and self.config.cpu_sample_us > 0 else None)
        cpu_before = read_maps(pids) if sampler is not None else {}
        lease = responder if isinstance(responder, JobLease) else None  # a GPU timing job's
        link = None
        if job.kind == "profile" and job.device == "cpu" and w.maker is not None and responder is not None:
            # its calls' inputs made outside the candidate's process (`cudagym.sandbox.worker.maker`)
            job = job.model_copy(update={"inputs_maker": True})
            responder = link = MakerLink(responder, *w.maker, timeout_s=limits.timeout_s, pids=pids)
            frames.on_mark, frames.on_acked = link.opened, link.acked
        quiet = (self._quiet_windows(device, w, begin=lease is None or lease.exclusive,
                                     shares=lease is not None and lease.shares) if timing and not refused else None)
        frames.responder, frames.answer_fd = quiet.responder(responder) if quiet else responder, w.stdin_fd
        if not refused:
            try:  # a large job line would block on the pipe until the worker reads it
                await asyncio.to_thread(write_all, w.stdin_fd, (job.model_dump_json() + "\n").encode())
            except OSError:  # the worker is gone: its outcome says how
                pass
        steps.mark("job_sent")

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(self.config.watchdog_interval_s)
                tree = self._tree(w.proc.pid)
                rss = cgroup.memory_bytes() if cgroup is not None else None
                if rss is None:  # no memory cgroup: resident sizes (forks' shared pages count twice)
                    rss = 0
                    for p in tree[1:] if w.waiter else tree:  # not the waiter's pages, shared with its server
                        try:
                            rss += p.memory_info().rss
                        except psutil.Error:
                            pass
                if rss > limits.memory_mb * 2**20:
                    outcome.memory_exceeded = True
                    self._kill(w)
                    return
                if (cgroup is None or not cgroup.caps_processes) and len(tree) > limits.max_processes:
                    outcome.process_limited = True
                    self._kill(w)
                    return

        output: list[bytes] = []

        async def collect_output() -> None:
            if w.proc.stdout is None:
                raise RuntimeError("the worker was started without a stdout pipe")
            size = 0
            while chunk := await w.proc.stdout.read(65536):
                if size < _OUTPUT_LIMIT:
                    output.append(chunk)
                    size += len(chunk)

        drained = threading.Event()

        def drain_samples() -> None:  # on its own thread: an event loop busy with other jobs let the
            # kernel's ring buffers fill (session 27: 411 of an honest verify's 926 samples lost in CI's
            # sixteen concurrent episodes, each lost one counted as foreign code). Not inside a call
            # unless the buffers are half full: this thread's hold on the interpreter delays the frames
            # thread's receipt of the call's marks (a timing job beside 8 busy processes: its windows
            # 3-5 ms longer, past `checks.cpu_windows_tight`'s allowance)
            while sampler is not None and not drained.wait(0.05):
                if not frames.in_call or sampler.fill() >= 0.5:
                    sampler.drain()

        drainer = None if sampler is None else threading.Thread(target=drain_samples, name="cudagym-samples",
                                                                daemon=True)
        if drainer is not None:
            drainer.start()
        dog = asyncio.ensure_future(watchdog())
        out_task = asyncio.ensure_future(collect_output())
        result_in = False
        try:
            done: set[Any] = set()
            while not refused:  # the limit, extended by the time timing jobs kept this job frozen
                # (and, for a timing job, by its wait for the GPU alone)
                extended = (running.frozen_s() if running else 0.0) + (lease.waited_s if lease else 0.0)
                left = limits.timeout_s + extended - (time.perf_counter() - t_ready)
                if left <= 0:
                    break
                done, _ = await asyncio.wait([asyncio.shield(frames.done), asyncio.shield(frames.final_seen)],
                                             timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
            result_in = frames.final_seen.done()
            if refused:
                pass
            elif not done:
                raise asyncio.TimeoutError
            if not result_in:  # the worker died without a result: wait for it, for its exit status
                await asyncio.wait_for(w.proc.wait(), timeout=10)
        except asyncio.TimeoutError:
            outcome.timed_out = not outcome.memory_exceeded and not outcome.process_limited
        finally:
            if quiet is not None:
                self._quiet_over(device, quiet)
                outcome.host_load = quiet.load_report()
            if running is not None:
                self._running.remove(running)
                self._pause_running([running], False)
            dog.cancel()
            drained.set()
            if drainer is not None:
                await asyncio.to_thread(drainer.join)
            steps.mark("worker")  # (the worker's own phases are in it)
            after_check = bool(foreign_since and not refused)  # did another process use the GPU meanwhile?
            tree = self._tree(w.proc.pid)
            job_pids = {p.pid for p in tree} if after_check else set()
            # the native code that appeared meanwhile, read before the kill (`cudagym.sandbox.maps`)
            code_seen = (unbuilt(code_before, exec_mappings(p.pid for p in tree), job.workspace,
                                 [job.artifact_dir or "", str(Path(job.cache_dir) / "inline") if job.cache_dir else ""],
                                 anonymous=job.device == "cpu",
                                 reachable=[str(Path(job.cache_dir).parent) if job.cache_dir else "", str(self.home)])
                         if result_in and job.kind in _CODE_READ_KINDS else [])
            cpu_maps = read_maps([p.pid for p in tree]) if sampler is not None and result_in else {}
            alive = thread_cpu_ns([p.pid for p in tree]) if sampler is not None and result_in else {}
            samples = sampler.close() if sampler is not None else None
            if samples is not None:
                samples.alive_ns = alive
                if link is not None and link.pid is not None:  # the inputs maker's work is the harness's
                    samples.taken = [t for t in samples.taken if t[0] != link.pid]
            steps.mark("maps_after")
            # The result is in (or the job is over): kill now rather than wait for the worker to
            # tear its CUDA context down. Killing the PID namespace's init takes every leftover
            # process with it; nothing the candidate started can write anything after this.
            self._kill(w)
            if cgroup is not None:  # and whatever left the namespace's tree (no PID namespace)
                cgroup.kill()
            if lease is not None and self.config.release_gpu_at_result:
                lease.release()  # killed: it launches nothing more (its context's teardown goes on)
            steps.mark("kill")
            if after_check:  # NVML's samples since the job began (the killed worker's processes are ours)
                seen = await self._device_check(device, foreign_since, job_pids) or foreign
                if seen is not None:
                    outcome.host_load["gpu_foreign"] = seen
                    if self.config.gpu_sharing == "refuse":
                        outcome.device_busy = f"another process used {device} during the timing job: {seen}"
                steps.mark("device_check_after")
            frames.stop()  # keeps the complete frames that arrived before the kill
            await frames.done
            if cgroup is not None and cgroup.pids_events_max() > 0:
                outcome.process_limited = True
        try:  # the output printed so far (the rest of a killed worker's would be shutdown noise)
            await asyncio.wait_for(asyncio.shield(out_task), timeout=0.05 if result_in else 5)
        except asyncio.TimeoutError:
            pass
        if not result_in:  # no result: its exit status says how it ended (a forked worker's comes
            try:  # from its fork server, after its output closes)
                await asyncio.wait_for(w.proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                pass
        text = b"".join(output).decode(errors="replace")
        outcome.output = "\n".join(ln for ln in text.splitlines() if not ln.startswith("USDT:"))[-_OUTPUT_LIMIT:]
        outcome.returncode = w.proc.returncode
        outcome.seconds = time.perf_counter() - t_ready
        collect_outcome(w.frames, w.shm_fd, job.nonce, outcome, w.release)
        steps.mark("collect")
        outcome.phases.update({f"parent_{k}": v for k, v in steps.spans.items()})
        if samples is not None and outcome.final is not None and outcome.final.get("ok"):
            windows, forged = (windows_from_marks(w.frames.marks, "returned", "request:trial") if job.kind == "verify"
                               else windows_from_marks(w.frames.marks, "returned", "request:call", stop=True))
            bounds = call_bounds(w.frames.marks) if job.kind != "verify" and not forged else []
            loaded = candidate_loaded_at(w.frames.marks) if job.kind == "profile" and not forged else None
            origin = await asyncio.to_thread(
                attribute, samples, cpu_maps, windows,
                [job.artifact_dir or "", str(Path(job.cache_dir) / "inline") if job.cache_dir else ""],
                [str(self.opwatch_dir / "opwatch")], cpu_before, bounds, loaded)
            origin.tamper = forged
            outcome.final["cpu_origin"] = origin.as_counts()
            if job.kind != "verify":  # each timed call's window: µs, samples, foreign ones, the least wall
                # time (µs) its samples leave room for (`CpuOrigin.least_wall_ns`) and the wall time between
                # its first and last samples of the candidate's work (`work_spread_ns`), in the calls' order
                least, spread = origin.least_wall_ns(), origin.work_spread_ns()
                outcome.final["cpu_windows"] = [
                    [round((b - a) * 1e6), n, bad,
                     *([round(least[i] / 1e3), round(spread[i] / 1e3)] if len(least) == len(windows) else [])]
                    for i, ((a, b), (n, bad)) in enumerate(zip(windows, origin.per_window, strict=True))]
                if link is not None:  # the harness's time in each window before the call could start (µs):
                    # from its open to the worker's resume, the maker's writes and the mark's hand-over
                    outcome.final["cpu_made_us"] = made_in_windows(windows, link.resumed_s)
                    # and the time the harness's processes waited for a CPU in each (why a loaded host's
                    # windows are long: `checks.cpu_windows_tight`)
                    outcome.final["cpu_waited_us"] = [round(s * 1e6) for s in link.waited_s]
        if code_seen and outcome.final is not None:  # beside what the worker reported of itself
            outcome.final["unbuilt_code"] = list(dict.fromkeys([*(outcome.final.get("unbuilt_code") or []),
                                                                *code_seen]))
        gone = asyncio.ensure_future(self._reap(w, cgroup, out_task, device if timing else None))
        self._reaping.add(gone)
        gone.add_done_callback(self._reaping.discard)
        return outcome, gone

    async def _reap(self, w: _Worker, cgroup: JobCgroup | None, out_task: asyncio.Future[None],
                    replenish: str | None) -> None:
        """After a job: wait for the killed worker to exit, release what it held, and (after a
        timing job) start the spares that were held back."""
        await w.proc.wait()
        try:
            await asyncio.wait_for(out_task, timeout=5)
        except asyncio.TimeoutError:
            out_task.cancel()
        w.close_pipes()
        if cgroup is not None:
            cgroup.remove()
        if replenish is not None:
            asyncio.ensure_future(self._replenish(replenish))


class _Steps:
    """Seconds of a job's steps in the parent, each from the previous mark (`perf_counter`)."""

    def __init__(self, t0: float) -> None:
        self._last = t0
        self.spans: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.spans[name] = self.spans.get(name, 0.0) + now - self._last
        self._last = now


def _visible_entry(index: str) -> str:
    """What names GPU `index` (of this process's visible GPUs) to a worker: this process's
    CUDA_VISIBLE_DEVICES entry for it where that is set (a Ray actor given GPU 3 sees it as
    cuda:0), else the index itself."""
    vis = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return vis[int(index)] if int(index) < len(vis) else index


def _num_threads(p: psutil.Process) -> int:
    try:
        return p.num_threads()
    except psutil.Error:
        return 1


def describe_isolation() -> dict[str, Any]:
    return {"namespaces": list(namespace_prefix()), "landlock_abi": landlock_abi()}
