"""The local sandbox: fresh worker processes on this host, started ahead of need.

Starting Python, importing torch and creating a CUDA context costs seconds, so the sandbox
keeps spare workers that have already paid for it and wait for one job each; after the job the
worker exits and a new spare takes its place. Each job therefore still gets a fresh process.

Subprocesses live on one private event-loop thread, so callers on any loop (or none) can use
the sandbox.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel

import cudagym
from cudagym.errors import SandboxError
from cudagym.sandbox.base import JobOutcome, Sandbox
from cudagym.sandbox.gpu import gpu_count
from cudagym.sandbox.limits import JobCgroup, landlock_abi, namespace_prefix
from cudagym.sandbox.protocol import TIMING_KINDS, FrameError, Job, decode_frames, encode_frame

_OUTPUT_LIMIT = 20_000


_READY_FRAME = encode_frame({"type": "ready"})


class LocalSandboxConfig(BaseModel):
    # Spares per device. A step makes up to four jobs back to back (verify + reference, baseline,
    # profile); each job consumes a spare, and a new one takes seconds to be ready.
    spare_workers: int | None = None  # None: 4 per GPU, 2 on the CPU
    python: str = sys.executable
    isolate: bool = True  # namespaces + cgroups where available (Landlock is always applied)
    watchdog_interval_s: float = 0.05
    start_timeout_s: float = 600.0  # a worker must be ready (torch imported) within this


class _GpuLease:
    """Timing jobs have a GPU to themselves; checks share it (a readers-writer lease)."""

    def __init__(self) -> None:
        self.shared = 0
        self.exclusive = False

    def try_acquire(self, exclusive: bool) -> bool:
        if self.exclusive or (exclusive and self.shared):
            return False
        if exclusive:
            self.exclusive = True
        else:
            self.shared += 1
        return True

    def release(self, exclusive: bool) -> None:
        if exclusive:
            self.exclusive = False
        else:
            self.shared -= 1


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    result_fd: int
    device: str


class LocalSandbox(Sandbox):
    def __init__(self, config: LocalSandboxConfig | None = None, home: Path | None = None):
        self.config = config or LocalSandboxConfig()
        self.home = Path(home or Path.home() / ".cache" / "cudagym" / "home")
        self.home.mkdir(parents=True, exist_ok=True)
        self._prefix = namespace_prefix() if self.config.isolate else ()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cudagym-sandbox", daemon=True)
        self._thread.start()
        self._spares: dict[str, list[_Worker]] = {}
        self._closed = False
        # One job per GPU at a time (timings need the device alone); on the CPU, timing jobs
        # run alone and checks share the cores.
        self._gpu_leases: list[_GpuLease] | None = None
        self._cpu_slots: asyncio.Semaphore | None = None
        self._cpu_timing: asyncio.Lock | None = None

    @property
    def isolation(self) -> dict[str, bool]:
        return {
            "network_namespace": "--net" in self._prefix,
            "pid_namespace": "--pid" in self._prefix,
            "landlock": landlock_abi() > 0,
        }

    # -- public API -------------------------------------------------------------------------
    async def run(self, job: Job, device: str) -> JobOutcome:
        fut = asyncio.run_coroutine_threadsafe(self._run(job, device), self._loop)
        return await asyncio.wrap_future(fut)

    def run_sync(self, job: Job, device: str) -> JobOutcome:
        return asyncio.run_coroutine_threadsafe(self._run(job, device), self._loop).result()

    def warm(self, device: str) -> None:
        """Start spare workers for `device` now (they are otherwise started on first use)."""
        asyncio.run_coroutine_threadsafe(self._replenish(device), self._loop).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _stop() -> None:
            for workers in self._spares.values():
                for w in workers:
                    self._kill(w)
                    await w.proc.wait()
                    w.proc._transport.close()  # type: ignore[attr-defined] - before the loop closes
                    os.close(w.result_fd)
            self._spares.clear()

        try:
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __del__(self) -> None:  # best effort: never leave spares behind
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

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
        }
        for k in ("OMP_NUM_THREADS", "LD_LIBRARY_PATH", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST",
                  "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            if k in os.environ:
                env[k] = os.environ[k]
        env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1] if device.startswith("cuda:") else ("" if device == "cpu" else "0")
        return env

    async def _spawn(self, device: str) -> _Worker:
        r, w = os.pipe()
        _grow_pipe(r)
        cmd = [*self._prefix, self.config.python, "-m", "cudagym.sandbox.worker", str(w)]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, pass_fds=(w,), env=self._env(device), start_new_session=True,
            )
        except OSError as e:
            os.close(r)
            os.close(w)
            raise SandboxError(f"could not start a worker: {e}") from e
        os.close(w)
        return _Worker(proc, r, device)

    async def _replenish(self, device: str) -> None:
        pool = self._spares.setdefault(device, [])
        want = self.config.spare_workers
        if want is None:
            want = 4 if device.startswith("cuda") else 2
        while len(pool) < want and not self._closed:
            pool.append(await self._spawn(device))

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
            os.close(w.result_fd)
        w = await self._spawn(device)
        if replenish:
            asyncio.ensure_future(self._replenish(device))
        return w

    def _kill(self, w: _Worker) -> None:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            w.proc.kill()
        except ProcessLookupError:
            pass

    @staticmethod
    def _tree(pid: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    async def _run(self, job: Job, device: str) -> JobOutcome:
        if device == "cuda":
            if self._gpu_leases is None:
                self._gpu_leases = [_GpuLease() for _ in range(max(gpu_count(), 1))]
            exclusive = job.kind in TIMING_KINDS
            while True:  # the first GPU that can take this job now
                for i, lease in enumerate(self._gpu_leases):
                    if lease.try_acquire(exclusive):
                        try:
                            return await self._run_on(job, f"cuda:{i}")
                        finally:
                            lease.release(exclusive)
                await asyncio.sleep(0.005)
        if self._cpu_slots is None:
            self._cpu_slots = asyncio.Semaphore(max(1, (os.cpu_count() or 2)))
            self._cpu_timing = asyncio.Lock()
        if job.kind in TIMING_KINDS:
            async with self._cpu_timing:
                return await self._run_on(job, device)
        async with self._cpu_slots:
            return await self._run_on(job, device)

    async def _run_on(self, job: Job, device: str) -> JobOutcome:
        timing = job.kind in TIMING_KINDS
        w = await self._take(device, replenish=not timing)
        limits = job.limits
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 30)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(w.result_fd, "rb", buffering=0))
        outcome = JobOutcome(final=None)
        try:  # a spare may still be starting: its start-up does not count against the job
            ready = await asyncio.wait_for(reader.readexactly(len(_READY_FRAME)), timeout=self.config.start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            ready = b""
        if ready != _READY_FRAME:
            self._kill(w)
            transport.close()
            await w.proc.wait()
            raise SandboxError("a sandbox worker failed to start (python -m cudagym.sandbox.worker)")
        t_ready = time.perf_counter()
        cgroup = None
        if self.config.isolate:  # after start-up, so torch's own thread pools are counted in the base
            base_threads = sum(_num_threads(p) for p in self._tree(w.proc.pid))
            cgroup = JobCgroup(max_pids=base_threads + limits.max_processes,
                               memory_mb=limits.memory_mb + 2048 if job.device == "cpu" else None)
            for p in self._tree(w.proc.pid):
                cgroup.add(p.pid)
        try:
            assert w.proc.stdin is not None
            w.proc.stdin.write((job.model_dump_json() + "\n").encode())
            await w.proc.stdin.drain()
            w.proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(self.config.watchdog_interval_s)
                tree = self._tree(w.proc.pid)
                rss = cgroup.memory_bytes() if cgroup is not None else None
                if rss is None:  # no memory cgroup: resident sizes (forks' shared pages count twice)
                    rss = 0
                    for p in tree:
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

        async def collect_output() -> bytes:
            assert w.proc.stdout is not None
            chunks, size = [], 0
            while True:
                chunk = await w.proc.stdout.read(65536)
                if not chunk:
                    return b"".join(chunks)
                if size < _OUTPUT_LIMIT:
                    chunks.append(chunk)
                    size += len(chunk)

        dog = asyncio.ensure_future(watchdog())
        out_task = asyncio.ensure_future(collect_output())
        try:
            data = await asyncio.wait_for(reader.read(), timeout=limits.timeout_s)
            await asyncio.wait_for(w.proc.wait(), timeout=10)
        except asyncio.TimeoutError:
            outcome.timed_out = not outcome.memory_exceeded and not outcome.process_limited
            self._kill(w)
            data = b""
            try:
                data = reader._buffer and bytes(reader._buffer) or b""  # what arrived before the kill
            except Exception:  # noqa: BLE001
                data = b""
        finally:
            dog.cancel()
            self._kill(w)  # init of the PID namespace: takes every leftover process with it
            transport.close()
            await w.proc.wait()
            w.proc._transport.close()  # type: ignore[attr-defined] - release pipes on this loop
            if cgroup is not None:
                if cgroup.pids_events_max() > 0:
                    outcome.process_limited = True
                cgroup.remove()
        try:
            out = await asyncio.wait_for(out_task, timeout=5)
        except asyncio.TimeoutError:
            out = b""
        if timing:
            asyncio.ensure_future(self._replenish(device))
        text = out.decode(errors="replace")
        outcome.output = "\n".join(ln for ln in text.splitlines() if not ln.startswith("USDT:"))[-_OUTPUT_LIMIT:]
        outcome.returncode = w.proc.returncode
        outcome.seconds = time.perf_counter() - t_ready
        _parse(data, job.nonce, outcome)
        return outcome


def _grow_pipe(fd: int) -> None:
    """Outputs travel through the pipe: a large buffer saves thousands of context switches."""
    import fcntl

    for size in (64 << 20, 16 << 20, 4 << 20, 1 << 20):
        try:
            fcntl.fcntl(fd, 1031, size)  # F_SETPIPE_SZ
            return
        except OSError:
            continue


def _num_threads(p: psutil.Process) -> int:
    try:
        return p.num_threads()
    except psutil.Error:
        return 1


def _parse(data: bytes, nonce: str, outcome: JobOutcome) -> None:
    try:
        frames = decode_frames(bytearray(data))  # writable: tensors are decoded without copies
    except FrameError as e:
        outcome.channel_error = f"malformed result channel: {e}"
        return
    finals = [h for h, _ in frames if h.get("type") == "final"]
    for h, payload in frames:
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


def describe_isolation() -> dict[str, Any]:
    return {"namespaces": list(namespace_prefix()), "landlock_abi": landlock_abi()}
