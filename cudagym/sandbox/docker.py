"""The docker sandbox: every worker in a container of its own, started ahead of need.

Where untrusted code must not share the host's file system view, user or kernel-facing
privileges, each worker runs in a container (docker SDK) with: a read-only root file system, a
non-root user, every capability dropped and `no-new-privileges`, no network, a pids, memory and
file-size limit, a small private `/tmp`, and the GPU it is given (a device request) or none.
Containers are started ahead of need (spares that have imported torch), used for one job and
removed, like the local backend's spare workers; the job protocol (`cudagym.sandbox.worker.wire`),
request frames answered on the worker's stdin and the result memory are the same.

A container's mounts are fixed when it starts, before its job is known, so each container gets
one job directory of its own (`/cudagym/job`, read-write) and everything else read-only:
- the job's workspace is copied into `/cudagym/job/ws` when the job starts, and the job's paths
  are rewritten to it; the candidate's writes there are discarded with the container;
- a job's extra writable directories (`Job.writable`: a build's staging, the compiler caches of
  a baseline) are copied in to `/cudagym/job/w<i>` and copied back after the job; only trusted
  jobs (no candidate code) have any;
- the channel: the FIFO `frames` (the result pipe), the FIFO `answers` (the worker's stdin),
  and the file `results` (result memory, mapped by the parent only once the container is dead);
- the evaluator's cache, the harness's op counter and the cudagym package, read-only at their
  host paths; with an image built from the host (`cudagym.sandbox.image`), the host's system
  directories and Python prefix too, read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import cudagym
from cudagym.errors import SandboxError
from cudagym.sandbox.worker.wire import JobOutcome, Responder
from cudagym.sandbox.config import DockerSandboxConfig
from cudagym.sandbox.opwatch import build_library
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.schedule import SpareWorkerSandbox
from cudagym.sandbox.worker.wire import TIMING_KINDS, FrameReader, Job, collect_outcome, write_all

JOB_DIR = "/cudagym/job"  # the container's own read-write directory (the job's files, the channel)
ROOTFS_LABEL = "cudagym.rootfs"  # "host": the image holds no system of its own (host paths mounted)
_OUTPUT_LIMIT = 20_000
_NOBODY = "65534:65534"


def docker_client(url: str | None = None, timeout: int = 120) -> Any:
    """A docker SDK client; SandboxError when the package or the daemon is missing."""
    try:
        import docker
    except ImportError:
        raise SandboxError("the docker backend needs the docker package: pip install 'cudagym[docker]'") from None
    try:
        client = docker.DockerClient(base_url=url, timeout=timeout, max_pool_size=64) if url else \
            docker.from_env(timeout=timeout, max_pool_size=64)
        client.ping()
    except Exception as e:  # noqa: BLE001 - docker raises several types for "no daemon"
        raise SandboxError(f"no docker daemon reachable ({type(e).__name__}: {e})") from None
    return client


def host_mounts() -> list[str]:
    """Host paths an image built from the host (`ROOTFS_LABEL` "host") needs, read-only: the
    system directories (real ones: merged-/usr symlinks are part of the image), the dynamic
    linker's cache and alternatives, and this interpreter's prefix when it lies elsewhere."""
    paths = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
             if os.path.isdir(p) and not os.path.islink(p)]
    paths += [p for p in ("/etc/ld.so.cache", "/etc/alternatives") if os.path.exists(p)]
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
            paths.append(prefix)
    return paths


def _exit_status(code: int | None) -> int | None:
    """A container's exit code as a process's returncode: 128+N (killed by signal N) is -N."""
    return -(code - 128) if code is not None and 128 < code < 160 else code


def _pids_file(container_id: str, name: str) -> str | None:
    """A file of the container's pids cgroup (v1 or v2, cgroupfs or systemd driver) while it
    runs (the cgroup goes with the container's exit), or None."""
    for d in (f"/sys/fs/cgroup/pids/docker/{container_id}", f"/sys/fs/cgroup/docker/{container_id}",
              f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope",
              f"/sys/fs/cgroup/pids/{container_id}", f"/sys/fs/cgroup/{container_id}"):  # cgroup parent "/"
        try:
            return Path(d, name).read_text()
        except OSError:
            continue
    return None


def _pids_events_max(container_id: str) -> int:
    """How often the container's pids limit refused a fork."""
    for line in (_pids_file(container_id, "pids.events") or "").splitlines():
        if line.startswith("max ") and line.split()[1].isdigit():
            return int(line.split()[1])
    return 0


@dataclass
class _Container:
    container: Any  # docker.models.containers.Container
    slot: Path  # the host side of JOB_DIR
    frames: FrameReader
    shm_fd: int
    device: str
    exited: asyncio.Future[int | None]  # the container's exit code, once it has stopped
    pidfd: int | None = None  # the worker's (the container's init) process, seen from the host
    stdin_fd: int | None = None  # opened when the job starts (the worker holds its read end by then)
    copy_back: list[tuple[Path, Path]] = field(default_factory=list)  # (slot dir, host dir) after the job
    paths: dict[str, str] = field(default_factory=dict)  # {path in the container: host path} of the job's dirs

    def release(self) -> None:
        self.frames.stop()
        for fd in (self.shm_fd, self.stdin_fd, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class DockerSandbox(SpareWorkerSandbox):
    """Runs each job in a fresh container; see the module docstring for what it isolates.

    `read_only` are host directories every job may read at their own paths (the evaluator's
    cache); `home` is the workers' HOME (read-only too, as in the local backend)."""

    _stop_timeout_s = 60.0
    config: DockerSandboxConfig

    def __init__(self, config: DockerSandboxConfig | None = None, home: Path | None = None,
                 read_only: list[Path] | None = None) -> None:
        self.config = config or DockerSandboxConfig()
        self.client = docker_client(self.config.docker_url)
        try:
            image = self.client.images.get(self.config.image)
        except Exception as e:  # noqa: BLE001 - docker.errors.ImageNotFound and API errors
            raise SandboxError(f"docker image {self.config.image!r} not found: build it with "
                               f"`cudagym sandbox image build` ({type(e).__name__})") from None
        self._host_rootfs = (image.labels or {}).get(ROOTFS_LABEL) == "host"
        self._cgroup_parent = self.config.cgroup_parent
        if self._cgroup_parent is None:
            try:
                driver = self.client.info().get("CgroupDriver")
            except Exception:  # noqa: BLE001 - docker.errors.APIError
                driver = None
            self._cgroup_parent = "/" if driver == "cgroupfs" else None
        image_env = dict(e.split("=", 1) for e in (image.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
        # the interpreter's own bin first (ninja and other tools pip installed; pyenv shims are not mounted)
        self._path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")]) \
            if self._host_rootfs else image_env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        self.home = Path(home or Path.home() / ".cache" / "cudagym" / "home")
        self.home.mkdir(parents=True, exist_ok=True)
        self.opwatch_dir = Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home() / ".cache" / "cudagym")
        build_library(self.opwatch_dir)
        self._read_only = [Path(p).resolve() for p in (read_only or [])]
        self._user = self.config.user or (_NOBODY if os.getuid() == 0 else f"{os.getuid()}:{os.getgid()}")
        uid, _, gid = self._user.partition(":")
        self._uid, self._gid = int(uid), int(gid or uid)
        if self._uid != os.getuid():  # the container's user reads what it is lent (a cache made by mkdtemp is 0700)
            for p in [*self._read_only, self.home, self.opwatch_dir]:
                if p.is_dir() and p.stat().st_uid == os.getuid() and (p.stat().st_mode & 0o005) != 0o005:
                    p.chmod(p.stat().st_mode | 0o005)
        self._runtime = self.config.runtime_dir / f"cudagym-docker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._runtime.mkdir(mode=0o755, parents=True)
        self._remove_orphans()
        self._spares: dict[str, list[_Container]] = {}
        self._reaping: set[asyncio.Future[None]] = set()  # containers of finished jobs, being removed
        self._start_loop("cudagym-docker")

    def _remove_orphans(self) -> None:
        """Remove the containers and job directories of sandboxes on this host whose process is
        gone (killed before `close`)."""
        for d in self.config.runtime_dir.glob("cudagym-docker-*-*"):
            pid = d.name.split("-")[2]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        try:
            leftover = self.client.containers.list(all=True, filters={"label": f"cudagym.host={socket.gethostname()}"})
        except Exception:  # noqa: BLE001
            return
        for c in leftover:
            pid = (c.labels or {}).get("cudagym.sandbox", "")
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                with contextlib.suppress(Exception):  # removed meanwhile
                    c.remove(force=True)

    @property
    def isolation(self) -> dict[str, bool]:
        return {"container": True, "network_namespace": True, "pid_namespace": True, "read_only_root": True,
                "non_root_user": self._uid != 0, "capabilities_dropped": True, "landlock": False}

    async def _stop_spares(self) -> None:
        spares = [c for pool in self._spares.values() for c in pool]
        self._spares.clear()
        await asyncio.gather(*(self._remove(c) for c in spares), *self._reaping, return_exceptions=True)

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self._runtime, ignore_errors=True)

    # -- containers -------------------------------------------------------------------------
    def _env(self, device: str) -> dict[str, str]:
        pkg_root = str(Path(cudagym.__file__).resolve().parent.parent)
        env = {
            "PATH": self._path,
            "LANG": "C.UTF-8",
            "HOME": str(self.home),
            "TMPDIR": f"{JOB_DIR}/tmp",
            "PYTHONPATH": pkg_root,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "CUDAGYM_DEVICE": "cuda" if device.startswith("cuda") else "cpu",
            "CUDAGYM_OPWATCH_DIR": str(self.opwatch_dir),
            "CUDAGYM_PREMAP_MB": "512" if device.startswith("cuda") else "0",
            "CUDA_VISIBLE_DEVICES": "0" if device.startswith("cuda") else "",  # the container sees its GPU only
        }
        for k in ("OMP_NUM_THREADS", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST"):
            if k in os.environ:
                env[k] = os.environ[k]
        if self._host_rootfs and "LD_LIBRARY_PATH" in os.environ:
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        return env

    def _mounts(self, slot: Path) -> list[Any]:
        from docker.types import Mount

        pkg_root = str(Path(cudagym.__file__).resolve().parent.parent)
        ro = [*(host_mounts() if self._host_rootfs else []), pkg_root, str(self.opwatch_dir),
              *map(str, self._read_only), str(self.home)]
        seen: set[str] = set()
        mounts = [Mount(JOB_DIR, str(slot), type="bind", read_only=False)]
        for p in ro:
            if p not in seen and os.path.exists(p):
                seen.add(p)
                mounts.append(Mount(p, p, type="bind", read_only=True))
        return mounts

    def _make_slot(self) -> tuple[Path, int, int]:
        """A job directory with its channel: the parent's read end of `frames` and the result memory."""
        slot = self._runtime / uuid.uuid4().hex[:12]
        slot.mkdir(mode=0o755)  # root's: the worker can write only inside what it is given
        for name in ("frames", "answers"):
            os.mkfifo(slot / name, 0o600)
        results = os.open(slot / "results", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(results, self.config.max_result_mb << 20)  # sparse
        (slot / "tmp").mkdir()  # TMPDIR while the worker starts (its job moves it into the workspace)
        for name in ("frames", "answers", "results", "tmp"):
            os.chown(slot / name, self._uid, self._gid)
        frames = os.open(slot / "frames", os.O_RDONLY | os.O_NONBLOCK)  # held before the worker opens it
        fcntl.fcntl(frames, fcntl.F_SETFL, fcntl.fcntl(frames, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return slot, frames, results

    def _create(self, device: str, slot: Path) -> Any:
        from docker.types import DeviceRequest, Ulimit

        limits = LimitsConfig()  # until a job sets its own (`_apply_limits`)
        python = self.config.python or (sys.executable if self._host_rootfs else "python3")
        gpu = ([DeviceRequest(device_ids=[device.split(":")[1]], capabilities=[["gpu"]])]
               if device.startswith("cuda:") else [])
        container = self.client.containers.create(
            self.config.image, [python, "-m", "cudagym.sandbox.worker", "--channel", JOB_DIR],
            user=self._user, environment=self._env(device), mounts=self._mounts(slot),
            working_dir=JOB_DIR, network_mode="none", read_only=True, cap_drop=["ALL"],
            security_opt=["no-new-privileges"], pids_limit=self.config.base_pids + limits.max_processes,
            mem_limit=f"{limits.memory_mb + 2048}m", memswap_limit=f"{limits.memory_mb + 2048}m",
            ulimits=[Ulimit(name="fsize", soft=limits.max_file_mb << 20, hard=self.config.max_file_mb_ceiling << 20),
                     Ulimit(name="core", soft=0, hard=0),
                     # no real-time priority or lower niceness even where the daemon's defaults allow
                     # them (SCHED_FIFO/RR need CAP_SYS_NICE, dropped, or RLIMIT_RTPRIO > 0)
                     Ulimit(name="rtprio", soft=0, hard=0), Ulimit(name="nice", soft=0, hard=0)],
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={self.config.tmp_mb}m,mode=755"},
            device_requests=gpu, cgroup_parent=self._cgroup_parent,
            labels={"cudagym.sandbox": str(os.getpid()), "cudagym.host": socket.gethostname()},
        )
        try:  # the worker is the container's init: killing it ends every process of the job
            container.start()
            container.reload()  # its host pid (State.Pid), for `_open_pidfd`
        except Exception:
            container.remove(force=True)
            raise
        return container

    @staticmethod
    def _open_pidfd(container: Any) -> int | None:
        """A pidfd of the container's init, so that a job's end is a signal from here rather than a
        round trip through dockerd, containerd and runc (a few hundred ms per job). None where pidfds
        are missing (Linux < 5.3) or the pid is not visible here (a remote daemon)."""
        pid = int(((container.attrs or {}).get("State") or {}).get("Pid") or 0)
        if pid <= 0 or not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        try:  # the pid is still this container's (not reused after an early exit)
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            cgroup = ""
        if container.id not in cgroup:
            os.close(fd)
            return None
        return fd

    def _apply_limits(self, c: _Container, limits: LimitsConfig, device: str) -> None:
        """The job's own memory and process caps (the container started with the defaults)."""
        memory = (limits.memory_mb + 2048) << 20 if device == "cpu" else limits.memory_mb << 20
        api = self.client.api
        # docker-py's update_container has no PidsLimit; the engine's endpoint does (API >= 1.40)
        # As the local backend's cap: the worker's own threads at rest (torch's pools), measured, plus the job's
        current = (_pids_file(c.container.id, "pids.current") or "").strip()
        base = int(current) if current.isdigit() else self.config.base_pids
        url = api._url("/containers/{0}/update", c.container.id)  # noqa: SLF001 - docker-py's helpers, as said above
        body = {"Memory": memory, "MemorySwap": memory, "PidsLimit": base + limits.max_processes}
        api._raise_for_status(api._post_json(url, data=body))  # noqa: SLF001 - docker-py's helpers, as said above

    async def _spawn(self, device: str) -> _Container:
        slot, frames_fd, shm = self._make_slot()
        try:
            container = await asyncio.to_thread(self._create, device, slot)
        except Exception as e:  # docker.errors.*
            for fd in (frames_fd, shm):
                os.close(fd)
            shutil.rmtree(slot, ignore_errors=True)
            raise SandboxError(f"could not start a sandbox container: {type(e).__name__}: {e}") from e
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int | None] = loop.create_future()
        frames = FrameReader(frames_fd, loop, self.config.max_result_mb << 20)
        pidfd = self._open_pidfd(container)

        def wait() -> None:  # one thread per container: `wait` blocks until it stops
            try:
                code: int | None = int(container.wait()["StatusCode"])
            except Exception:  # noqa: BLE001 - removed under us, daemon gone
                code = None
            frames.stop()  # the FIFO's remaining frames are still read; a worker that never opened it ends here

            def set_() -> None:
                if not exited.done():
                    exited.set_result(code)
            try:
                loop.call_soon_threadsafe(set_)
            except RuntimeError:
                pass

        threading.Thread(target=wait, name="cudagym-docker-wait", daemon=True).start()
        return _Container(container, slot, frames, shm, device, exited, pidfd=pidfd)

    async def _take(self, device: str, replenish: bool = True) -> _Container:
        pool = self._spares.setdefault(device, [])
        while pool:
            c = pool.pop(0)
            if not c.exited.done():
                break
            asyncio.ensure_future(self._remove(c))
        else:
            c = await self._spawn(device)
        if replenish:
            asyncio.ensure_future(self._replenish(device))
        return c

    async def _remove(self, c: _Container) -> None:
        c.release()
        with contextlib.suppress(Exception):  # already gone
            await asyncio.to_thread(c.container.remove, force=True)
        shutil.rmtree(c.slot, ignore_errors=True)

    def _pause(self, workers: list[_Container], pause: bool) -> None:
        for c in workers:
            with contextlib.suppress(Exception):  # it may have exited meanwhile
                (c.container.pause if pause else c.container.unpause)()

    def _is_starting(self, worker: _Container) -> bool:
        return not worker.frames.ready.done() and not worker.exited.done()

    # -- one job ----------------------------------------------------------------------------
    def _stage(self, c: _Container, job: Job) -> Job:
        """Copy the job's directories into the container's job directory; the job as the container sees it."""
        moves: list[tuple[str, str]] = []
        if job.workspace:
            moves.append((job.workspace, f"{JOB_DIR}/ws"))
        for i, d in enumerate(job.writable):
            moves.append((d, f"{JOB_DIR}/w{i}"))
            c.copy_back.append((c.slot / f"w{i}", Path(d)))
        c.paths = {inside: host for host, inside in moves}
        for host, at in moves:
            dst = c.slot / Path(at).name
            if os.path.isdir(host):
                shutil.copytree(host, dst, symlinks=True)
            else:
                dst.mkdir()
            if os.getuid() == 0 and self._uid != 0:
                for root, dirs, files in os.walk(dst):
                    for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                        os.lchown(name, self._uid, self._gid)

        def inside(path: str | None) -> str | None:
            if not path:
                return path
            for host, target in moves:
                if path == host or path.startswith(host.rstrip("/") + "/"):
                    return target + path[len(host.rstrip("/")):]
            return path

        return job.model_copy(update={"workspace": inside(job.workspace) or "",
                                      "writable": [inside(d) for d in job.writable],
                                      "inline_build_root": inside(job.inline_build_root),
                                      "artifact_dir": inside(job.artifact_dir)})

    async def _ready(self, device: str) -> _Container:
        """A spare container of `device` that is ready; SandboxError (with its logs) if none starts."""
        c = await self._take(device)  # spares start now; a timing job pauses them in its quiet windows
        try:
            either: list[asyncio.Future[Any]] = [asyncio.shield(c.frames.ready), asyncio.shield(c.exited)]
            await asyncio.wait(either, timeout=self.config.start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._unused(c)
            raise
        if not (c.frames.ready.done() and c.frames.ready.result()):
            logs = await asyncio.to_thread(self._logs, c)
            await self._remove(c)
            raise SandboxError(f"a sandbox container failed to start (image {self.config.image}):\n{logs[-2000:]}")
        return c

    def _unused(self, c: _Container) -> None:
        self._spares.setdefault(c.device, []).insert(0, c)

    async def _run_on(self, job: Job, device: str, responder: Responder | None,
                      c: _Container) -> tuple[JobOutcome, asyncio.Future[None]]:
        timing = job.kind in TIMING_KINDS
        frames, outcome = c.frames, JobOutcome(final=None)
        t_ready = time.perf_counter()
        try:
            inner = await asyncio.to_thread(self._stage, c, job)
            outcome.paths = c.paths
            await asyncio.to_thread(self._apply_limits, c, job.limits, job.device)
            c.stdin_fd = os.open(c.slot / "answers", os.O_WRONLY | os.O_NONBLOCK)  # the worker holds the read end
            fcntl.fcntl(c.stdin_fd, fcntl.F_SETFL, fcntl.fcntl(c.stdin_fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except Exception:
            await self._remove(c)
            raise
        quiet = self._quiet_windows(device) if timing else None
        frames.responder, frames.answer_fd = quiet.responder(responder) if quiet else responder, c.stdin_fd
        try:
            await asyncio.to_thread(write_all, c.stdin_fd, (inner.model_dump_json() + "\n").encode())
        except OSError:  # the worker is gone: its outcome says how
            pass
        result_in = False
        try:
            done, _ = await asyncio.wait([asyncio.shield(frames.done), asyncio.shield(frames.final_seen)],
                                         timeout=job.limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            result_in = frames.final_seen.done()
            if not done:
                outcome.timed_out = True
            elif not result_in:  # the worker died without a result: its exit status says why
                await asyncio.wait_for(asyncio.shield(c.exited), timeout=10)
        except asyncio.TimeoutError:
            pass
        finally:
            if quiet is not None:
                self._quiet_over(device, quiet)
            outcome.process_limited = _pids_events_max(c.container.id) > 0  # read before the cgroup goes
            dead = await self._kill(c)  # the result is in (or the job is over): nothing runs after this
            frames.stop()
            await frames.done
        if c.exited.done():
            code = c.exited.result()
        elif dead and (result_in or outcome.timed_out):  # killed here: docker's exit event would say the same, later
            code = 128 + signal.SIGKILL
        else:
            try:
                code = await asyncio.wait_for(asyncio.shield(c.exited), timeout=30)
            except asyncio.TimeoutError:  # the daemon did not report the exit: no status
                code = None
        if not result_in and (await asyncio.to_thread(self._state, c)).get("OOMKilled"):
            outcome.memory_exceeded, outcome.timed_out = True, False
        outcome.returncode = _exit_status(code)
        outcome.seconds = time.perf_counter() - t_ready
        text = await asyncio.to_thread(self._logs, c)
        outcome.output = "\n".join(ln for ln in text.splitlines() if not ln.startswith("USDT:"))[-_OUTPUT_LIMIT:]
        collect_outcome(frames, c.shm_fd, job.nonce, outcome, c.release)
        for src, dst in c.copy_back:  # trusted jobs' outputs (staging, compiler caches)
            if src.is_dir():
                await asyncio.to_thread(shutil.copytree, src, dst, symlinks=True, dirs_exist_ok=True)
        gone = asyncio.ensure_future(self._reap(c, device if timing else None))
        self._reaping.add(gone)
        gone.add_done_callback(self._reaping.discard)
        return outcome, gone

    async def _kill(self, c: _Container, attempts: int = 3) -> bool:
        """SIGKILL the container's init (the worker), which ends its PID namespace, and wait until
        every process of the job is gone; True once they are.

        Through the worker's pidfd where there is one: the kernel reports the init's exit only
        after every other process of its namespace has been reaped, so a readable pidfd means
        nothing of the job runs any more (docker's own exit event follows later). Otherwise
        through the daemon, which may answer a kill with an error when the exit takes long (a
        container of a thousand processes, a loaded host) or when it stopped already: retried."""
        if c.pidfd is not None:
            try:
                signal.pidfd_send_signal(c.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError:
                attempts = max(attempts, 1)
            else:
                if await self._pidfd_exited(c.pidfd, timeout_s=20):
                    return True
        for _ in range(attempts):
            if c.exited.done():
                return True
            with contextlib.suppress(Exception):  # docker.errors.APIError: not running, or no exit event yet
                await asyncio.to_thread(c.container.kill)
            try:
                await asyncio.wait_for(asyncio.shield(c.exited), timeout=20)
                return True
            except asyncio.TimeoutError:
                continue
        return c.exited.done()

    @staticmethod
    async def _pidfd_exited(pidfd: int, timeout_s: float) -> bool:
        """Whether the process of `pidfd` exits within `timeout_s` (a pidfd is readable once it has)."""
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def exited() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(pidfd, exited)
        try:
            await asyncio.wait_for(gone, timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(pidfd)

    def _state(self, c: _Container) -> dict[str, Any]:
        try:
            c.container.reload()
            return dict(c.container.attrs.get("State") or {})
        except Exception:  # noqa: BLE001
            return {}

    @staticmethod
    def _logs(c: _Container) -> str:
        try:
            return c.container.logs(stdout=True, stderr=True, tail=2000).decode(errors="replace")[-_OUTPUT_LIMIT:]
        except Exception:  # noqa: BLE001
            return ""

    async def _reap(self, c: _Container, replenish: str | None) -> None:
        await self._remove(c)
        if replenish is not None:
            asyncio.ensure_future(self._replenish(replenish))
