"""A fork server of sandbox workers: one warm parent per device, and each worker a fork of it.

A spawned worker pays for Python, `import torch`, the harness and dynamo before it can create its
CUDA context: about 13 s of one core each on an H100 host (16 s when 16 start at once), and a
check takes two workers. The fork server pays for that host-side start-up once
(`worker.entry.warm_host`); a worker forked from it only creates its CUDA context, runs the
profiler's first session, loads the timer's kernels and maps its result memory: 1.9 s alone,
4.9 s when 16 start at once (`benchmarks/probe_worker_start.py`, H100).

Why a fork is as fresh as a spawn: the server never runs a job, candidate code or any CUDA
driver call (torch's availability check goes through NVML; the profiler, whose first session
initializes the driver, runs in the worker), so a worker starts from the same state a spawned
worker has after its imports, in its own copy-on-write memory. Each worker is then set apart
exactly as a spawned one: its own session (a process group the sandbox signals and kills),
niceness, and, as `unshare` would give it, its own network, mount and PID namespaces (the
worker is the PID namespace's init; its parent only waits for it and dies with its status),
then gives up its privileges (`limits.drop_privileges`).

Nothing outlives the sandbox's process, however it ends (SIGKILL included): the server dies
with the sandbox's thread that started it, each forked child with the server, and a worker
with the parent that waits for it (PR_SET_PDEATHSIG at each step, checked against a parent
that died first); a worker that dies takes its PID namespace with it.

Protocol, on a SOCK_SEQPACKET socket (one JSON message per packet):
- server -> sandbox, once: ``{"ready": true, "fork_ok": bool, "startup_s": {...}}``; `fork_ok`
  is whether a test fork could still use CUDA and NVML (False: the sandbox spawns workers instead).
- sandbox -> server: ``{"spawn": id, "nice": n, "unshare": [...]}`` with four descriptors
  (the worker's stdin, its stdout and stderr, its result pipe, its result memory);
  server -> sandbox: ``{"spawned": id, "pid": pid}``.
- server -> sandbox, as each worker exits: ``{"exit": pid, "code": returncode}`` (negative: the
  signal that killed it, as `subprocess` reports it).
The server exits when the sandbox closes its end.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import json
import os
import select
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from cudagym.errors import SandboxError
from cudagym.sandbox.worker.wire import MAKER_FDS

if TYPE_CHECKING:
    from cudagym.sandbox.worker.state import WorkerState

# the descriptors a forked worker finds its channel on (what `worker.entry.main` gets from argv)
RESULT_FD, SHM_FD = 3, 4
SEEDS_FD, MADE_FD = MAKER_FDS
_CLONE = {"net": 0x40000000, "mount": 0x00020000, "pid": 0x20000000}
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8


def unshare_flags(prefix: tuple[str, ...]) -> list[str]:
    """The namespaces of an `unshare` command line (`limits.namespace_prefix`), as this module
    names them: "net", "mount", "pid" and "mount_proc"."""
    names = {"--net": "net", "--mount": "mount", "--pid": "pid", "--mount-proc": "mount_proc"}
    return [names[a] for a in prefix if a in names]


# -- the server (in its own process) ---------------------------------------------------------
def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode())


def _shut_nvml() -> None:
    """End every NVML session of this process. torch's NVML-based CUDA check opens one and never
    closes it; a child forked with it open inherits a session that no longer works, and its own
    `nvmlInit` only counts one more user of it (the workers' telemetry read "NVML is not available")."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return
    for _ in range(1024):
        if lib.nvmlShutdown() != 0:  # NVML_ERROR_UNINITIALIZED: no session left
            return


def _fork_keeps_cuda() -> bool:
    """Whether a child forked now can still use CUDA and NVML: torch has not marked forks bad
    (it does once anything in this process touched the CUDA driver through it), and NVML
    starts in the child."""
    import torch

    pid = os.fork()
    if pid == 0:
        if torch.cuda._is_in_bad_fork():  # noqa: SLF001 - torch's own fork check
            os._exit(3)
        try:
            import pynvml
        except ImportError:
            os._exit(0)
        try:
            pynvml.nvmlInit()
            pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001
            os._exit(4)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def serve(control_fd: int) -> None:
    """The server's loop: fork a worker per request, report each one's exit."""
    from cudagym.sandbox.limits import die_with_parent

    sandbox = int(os.environ.get("CUDAGYM_SANDBOX_PID", "0"))
    die_with_parent(lambda: not sandbox or os.getppid() == sandbox)
    server = os.getpid()
    from cudagym.sandbox.worker import entry

    sock = socket.socket(fileno=control_fd)
    entry.pin_cpus(os.environ.get("CUDAGYM_CPUS"))  # its workers inherit it
    clock = entry.StartupClock()
    state = entry.warm_host(clock)
    _shut_nvml()
    cuda = os.environ.get("CUDAGYM_DEVICE") == "cuda"
    _send(sock, {"ready": True, "fork_ok": _fork_keeps_cuda() if cuda else True, "startup_s": clock.steps})
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    while True:
        watched: list[socket.socket | int] = [sock, wake_r]
        readable, _, _ = select.select(watched, [], [], 1.0)
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while True:  # reap every worker that has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock in readable:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 65536, 6)
            except ConnectionResetError:
                msg, fds = b"", []
            if not msg:
                os._exit(0)
            req = json.loads(msg)
            t_fork = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _become_worker(req, fds, [sock.fileno(), wake_r, wake_w], t_fork, server, state)
            for fd in fds:
                os.close(fd)
            _send(sock, {"spawned": req["spawn"], "pid": pid})


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _become_worker(req: dict[str, Any], fds: list[int], server_fds: list[int], t_fork: float, server: int,
                   state: WorkerState) -> None:
    """In the forked child: set it apart like a spawned worker, then serve one job with its copy of
    the server's `state`. Never returns."""
    try:
        from cudagym.sandbox.limits import die_with_parent, drop_privileges

        die_with_parent(lambda: os.getppid() == server)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        high = [os.dup(fd) for fd in fds]  # above every target number, then onto them
        for fd in fds:
            os.close(fd)
        stdin, out, result, shm, *maker = high
        pairs = [(stdin, 0), (out, 1), (out, 2), (result, RESULT_FD), (shm, SHM_FD)]
        pairs += list(zip(maker, (SEEDS_FD, MADE_FD)))  # the inputs maker's pipes (`worker.maker`)
        for src, dst in pairs:
            os.dup2(src, dst, inheritable=True)
        last = MADE_FD if maker else SHM_FD
        os.closerange(last + 1, max(high) + 1)
        os.setsid()
        if req.get("nice"):
            os.nice(int(req["nice"]))
        flags = req.get("unshare") or []
        libc = _libc()
        mask = sum(_CLONE[f] for f in flags if f in _CLONE)
        if mask:
            _check(libc.unshare(mask), "unshare")
        if "pid" in flags:  # the worker must be the new namespace's first process: fork once more
            # its parent is outside the namespace (getppid() reads 0): the parent holds a pipe's
            # write end, and the worker sees it closed if the parent died before PR_SET_PDEATHSIG
            alive_r, alive_w = os.pipe()
            waiter = os.fork()
            if waiter:
                os.close(alive_r)
                _wait_for_init(waiter)
            os.close(alive_w)
            die_with_parent(lambda: not select.select([alive_r], [], [], 0)[0])
            os.close(alive_r)
        if "mount_proc" in flags:  # a /proc of its own PID namespace
            _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
            _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount /proc")
        drop_privileges()  # still one thread: every thread the worker starts inherits it
        from cudagym.sandbox.worker import entry

        main = os.path.join(os.path.dirname(entry.__file__), "__main__.py")
        sys.argv = [main, str(RESULT_FD), str(SHM_FD)]  # as a spawned worker's
        if maker:
            sys.argv += [str(SEEDS_FD), str(MADE_FD)]
            state.maker_fds = (SEEDS_FD, MADE_FD)
        entry.pin_cpus(os.environ.get("CUDAGYM_CPUS"))
        entry.serve(RESULT_FD, SHM_FD, entry.StartupClock({"fork": time.perf_counter() - t_fork}), state)
    except BaseException as e:  # noqa: BLE001 - a worker that cannot start says why, and exits
        try:
            os.write(2, f"cudagym fork server: the worker could not start: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(1)
    os._exit(0)


def _wait_for_init(pid: int) -> None:
    """In the worker's parent (outside its PID namespace), when `pid` is not 0: hold nothing,
    wait for the worker, exit with its status, as `unshare --fork` does. Returns in the worker."""
    if pid == 0:
        return
    for fd in range(0, SHM_FD + 1):  # the channel's ends stay with the worker alone
        try:
            os.close(fd)
        except OSError:
            pass
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


# -- the sandbox's side ----------------------------------------------------------------------
class ForkedWorker:
    """A worker forked by the server, as the sandbox sees it: what it uses of
    `asyncio.subprocess.Process` (`pid`, `returncode`, `stdout`, `wait()`), plus `close()`."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, transport: asyncio.BaseTransport,
                 exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self.stdout = stdout
        self._transport = transport
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        self._transport.close()


class ForkServer:
    """The sandbox's handle on one server process (one per device), on the sandbox's loop."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python, self.env = python, env
        self.proc: asyncio.subprocess.Process | None = None
        self.fork_ok = False
        self.startup_s: dict[str, float] = {}
        self._sock: socket.socket | None = None
        self._ids = itertools.count()
        self._spawned: dict[int, asyncio.Future[int]] = {}  # request -> the worker's pid
        self._exits: dict[int, asyncio.Future[int]] = {}  # pid -> its return code, until it exits
        self._exited_early: dict[int, int] = {}  # exits reported before `fork` took the pid
        self._reader: asyncio.Task[None] | None = None
        self._stderr_tail = b""

    async def start(self, timeout_s: float) -> None:
        """Start the server and wait until it is warm; SandboxError if it is not."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "cudagym.sandbox.forkserver", str(theirs.fileno()), pass_fds=(theirs.fileno(),),
                env={**self.env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "CUDAGYM_SANDBOX_PID": str(os.getpid())},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as e:
            ours.close()
            raise SandboxError(f"could not start the fork server: {e}") from e
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        loop = asyncio.get_running_loop()
        try:
            first = await asyncio.wait_for(loop.sock_recv(ours, 65536), timeout=timeout_s)
            hello = json.loads(first) if first else {}
        except (asyncio.TimeoutError, OSError, ValueError):
            hello = {}
        if not hello.get("ready"):
            await self.close()
            err = b""
            if self.proc.stderr is not None:
                err = await self.proc.stderr.read()
            raise SandboxError("the fork server failed to start" + (f": {err.decode(errors='replace')[-2000:]}"
                                                                  if err.strip() else ""))
        self.fork_ok = bool(hello.get("fork_ok"))
        self.startup_s = hello.get("startup_s") or {}
        self._reader = asyncio.ensure_future(self._read())
        asyncio.ensure_future(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        """Keep the end of what the server prints (its warnings), so that it never blocks on a full pipe."""
        if self.proc is None or self.proc.stderr is None:
            raise RuntimeError("the fork server is not started (no stderr pipe)")
        while chunk := await self.proc.stderr.read(65536):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def _read(self) -> None:
        if self._sock is None:
            raise RuntimeError("the fork server is not connected")
        loop = asyncio.get_running_loop()
        try:
            while msg := await loop.sock_recv(self._sock, 65536):
                m = json.loads(msg)
                if "spawned" in m:
                    fut = self._spawned.pop(m["spawned"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(int(m["pid"]))
                elif "exit" in m:
                    exited = self._exits.pop(int(m["exit"]), None)
                    if exited is None:
                        self._exited_early[int(m["exit"])] = int(m["code"])
                    elif not exited.done():
                        exited.set_result(int(m["code"]))
        except (OSError, ValueError):
            pass
        finally:  # the server is gone: nothing more will be reported
            for fut in self._spawned.values():
                if not fut.done():
                    fut.set_exception(SandboxError("the fork server exited"))
            for pid, exited in self._exits.items():  # no one reports these exits now: watch them
                self._watch_orphan(pid, exited)
            self._exits.clear()

    def _watch_orphan(self, pid: int, exited: asyncio.Future[int]) -> None:
        """Resolve `exited` once worker `pid`, whose server is gone, exits (a pidfd turns
        readable); its status is lost with the server: 255, as asyncio reports an unknown child."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # already gone
            if not exited.done():
                exited.set_result(255)
            return
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if not exited.done():
                exited.set_result(255)

        loop.add_reader(pidfd, gone)

    async def fork(self, stdin: int, stdout: int, result: int, shm: int, stdout_r: int, nice: int,
                   unshare: list[str], maker: tuple[int, int] | None = None) -> ForkedWorker:
        """A new worker on these descriptors (the caller closes its copies of the worker's ends);
        `stdout_r`, the read end of its stdout, becomes the `ForkedWorker`'s `stdout`; `maker`:
        the worker's ends of its inputs maker's pipes (`cudagym.sandbox.worker.maker`)."""
        if not self.alive or self._sock is None:
            tail = self._stderr_tail.decode(errors="replace").strip()
            raise SandboxError("the fork server is not running" + (f": {tail[-2000:]}" if tail else ""))
        loop = asyncio.get_running_loop()
        request = next(self._ids)
        spawned: asyncio.Future[int] = loop.create_future()
        self._spawned[request] = spawned
        msg = json.dumps({"spawn": request, "nice": nice, "unshare": unshare}).encode()
        while True:
            try:
                socket.send_fds(self._sock, [msg], [stdin, stdout, result, shm, *(maker or ())])
                break
            except BlockingIOError:
                await asyncio.sleep(0.001)
            except OSError as e:
                self._spawned.pop(request, None)
                raise SandboxError(f"the fork server did not take the request: {e}") from e
        pid = await spawned
        exited: asyncio.Future[int] = loop.create_future()
        if pid in self._exited_early:
            exited.set_result(self._exited_early.pop(pid))
        elif self.alive:
            self._exits[pid] = exited
        else:
            self._watch_orphan(pid, exited)
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(stdout_r, "rb", 0))
        return ForkedWorker(pid, reader, transport, exited)

    async def close(self) -> None:
        """Stop the server (its workers are the sandbox's to stop: they are not its children's)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


if __name__ == "__main__":
    try:
        serve(int(sys.argv[1]))
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
