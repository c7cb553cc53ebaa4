"""Isolation primitives of the local sandbox, each used where the OS allows it.

- Writes: Landlock (Linux >= 5.13) confines file creation/modification to the workspace and a
  few device files; it needs no privileges and cannot be undone by the sandboxed process.
- Processes: the pids cgroup (v2, or v1 as on some VMs) caps processes+threads of a job.
  Root ignores RLIMIT_NPROC, so an rlimit alone would not stop a fork bomb.
- Memory: RLIMIT_AS on the CPU target; on CUDA (whose context reserves huge virtual ranges) a
  resident-memory watchdog in the parent, plus the memory cgroup where it exists.
- Network: the worker starts in its own network namespace (`unshare --net`).
- Everything: a PID namespace whose init is the worker, so killing it kills every descendant.
- Lifetime: each process between the evaluator and a worker dies with its parent
  (`die_with_parent`), so no worker outlives its evaluator, whatever ended it.
- Privileges: a worker gives up every capability, its bounding set and real-time scheduling
  (`drop_privileges`) before it runs anything of the candidate's.
- Fencing: a job's cgroup can be frozen (`JobCgroup.freeze`) while another job's timed loop runs.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

# Landlock rights that modify the file system; reads stay allowed everywhere.
_FILE_WRITE_NAMES = ("WRITE_FILE", "TRUNCATE")
_DIR_WRITE_NAMES = ("REMOVE_DIR", "REMOVE_FILE", "MAKE_CHAR", "MAKE_DIR", "MAKE_REG", "MAKE_SOCK",
                    "MAKE_FIFO", "MAKE_BLOCK", "MAKE_SYM", "REFER")
_WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")


@lru_cache(maxsize=1)
def landlock_abi() -> int:
    try:
        import landlock

        return int(landlock.landlock_abi_version())
    except Exception:  # noqa: BLE001 - not Linux, no Landlock, or the library is missing
        return 0


def restrict_writes(writable_dirs: list[str]) -> bool:
    """Confine this process and its future children's writes to `writable_dirs` (+ /dev/null etc.).

    Returns False (and changes nothing) where Landlock is unavailable.
    """
    abi = landlock_abi()
    if abi < 1:
        return False
    from landlock import FSAccess, Ruleset

    def flags(names: tuple[str, ...]) -> FSAccess:
        out = FSAccess(0)
        for n in names:
            if n == "REFER" and abi < 2 or n == "TRUNCATE" and abi < 3:
                continue
            out |= getattr(FSAccess, n)
        return out

    file_w, dir_w = flags(_FILE_WRITE_NAMES), flags(_DIR_WRITE_NAMES)
    rs = Ruleset(restrict_rules=file_w | dir_w)
    for d in writable_dirs:
        if os.path.isdir(d):
            rs.allow(d, rules=file_w | dir_w)
    devices = [p for p in _WRITABLE_DEVICES if os.path.exists(p)]
    devices += [str(p) for p in Path("/dev").glob("nvidia*") if not p.is_dir()]
    for p in devices:
        try:
            rs.allow(p, rules=file_w)
        except OSError:
            pass
    rs.apply()
    return True


def apply_rlimits(*, max_file_mb: int, memory_mb: int | None) -> None:
    """File-size, core-dump and (CPU target) address-space limits of this process."""
    fsize = max_file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb is not None:
        cur = _vm_size_bytes()
        limit = cur + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# -- lifetime and privileges ------------------------------------------------------------------
_PR_SET_PDEATHSIG, _PR_CAPBSET_READ, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 23, 24, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAP_VERSION_3 = 0x20080522


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_alive: Callable[[], bool]) -> None:
    """SIGKILL this process when the thread that started it exits (PR_SET_PDEATHSIG), SIGKILL
    included; then `parent_alive()` is asked, since the parent may have died before the request
    (this process then exits at once). Only the calling thread's parent counts: call it first
    thing in a new, single-threaded process."""
    libc = _libc()
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_PDEATHSIG): {os.strerror(e)}")
    if not parent_alive():
        os._exit(1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    """Give up every privilege that could bend a timing or reach beyond the job, for good:
    no new privileges (setuid/file capabilities, NO_NEW_PRIVS), an empty bounding set and
    ambient set, no effective, permitted or inheritable capability (CAP_SYS_NICE among them),
    and no real-time priority or lower niceness (RLIMIT_RTPRIO, RLIMIT_NICE 0: a SCHED_FIFO or
    SCHED_RR request, or a negative nice, fails with EPERM).

    Capabilities are per thread: call it while the process has one thread (before torch starts
    its pools), so that every thread started later inherits the empty sets. The process keeps
    its uid (root in CI and on the GPU machines: the workspace and caches are root's); writes
    stay confined by Landlock and other processes are out of sight in the PID namespace."""
    libc = _libc()
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):  # dropping needs CAP_SETPCAP, so before the capset below
        if libc.prctl(_PR_CAPBSET_READ, cap, 0, 0, 0) == 1:
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")
    for limit in (resource.RLIMIT_RTPRIO, resource.RLIMIT_NICE):
        resource.setrlimit(limit, (0, 0))


@lru_cache(maxsize=1)
def parent_death_prefix() -> tuple[str, ...]:
    """A command prefix that makes the spawned command die with the thread that started it
    (`setpriv --pdeathsig KILL`), or () where setpriv cannot."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    try:
        r = subprocess.run([setpriv, "--pdeathsig", "KILL", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (setpriv, "--pdeathsig", "KILL") if r.returncode == 0 else ()


# -- network and pid namespaces ---------------------------------------------------------------
@lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """`unshare` arguments giving a worker its own network, mount and PID namespaces, or ()."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for args in (
        (unshare, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"),
        (unshare, "--net", "--pid", "--fork", "--kill-child"),
        (unshare, "--net"),
    ):
        try:
            r = subprocess.run([*args, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return args
    return ()


# -- cgroups ----------------------------------------------------------------------------------
class JobCgroup:
    """A pids (and, where possible, memory) cgroup for one worker; `None` parts where unavailable."""

    def __init__(self, max_pids: int, memory_mb: int | None) -> None:
        self.paths: list[Path] = []
        name = f"cudagym-{uuid.uuid4().hex[:12]}"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "pids" in v2.read_text():
            self._try(Path("/sys/fs/cgroup") / name, {"pids.max": str(max_pids)}
                      | ({"memory.max": str(memory_mb << 20)} if memory_mb else {}))
        else:
            self._try(Path("/sys/fs/cgroup/pids") / name, {"pids.max": str(max_pids)})
            if memory_mb:
                self._try(Path("/sys/fs/cgroup/memory") / name, {"memory.limit_in_bytes": str(memory_mb << 20)})
            self._try(Path("/sys/fs/cgroup/freezer") / name, {})

    def _try(self, path: Path, settings: dict[str, str]) -> None:
        try:
            path.mkdir()
        except OSError:
            return
        try:
            for k, v in settings.items():
                (path / k).write_text(v)
        except OSError:
            path.rmdir()
            return
        self.paths.append(path)

    @property
    def caps_processes(self) -> bool:
        return any((p / "pids.max").exists() for p in self.paths)

    def add(self, pid: int) -> None:
        for p in self.paths:
            try:
                (p / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass

    def memory_bytes(self) -> int | None:
        """Memory charged to the job (pages shared copy-on-write by forks count once), or None."""
        for p in self.paths:
            for name in ("memory.current", "memory.usage_in_bytes"):
                f = p / name
                if f.exists():
                    try:
                        return int(f.read_text())
                    except (OSError, ValueError):
                        return None
        return None

    def pids_events_max(self) -> int:
        """How often the pids limit refused a fork."""
        for p in self.paths:
            ev = p / "pids.events"
            if ev.exists():
                for line in ev.read_text().splitlines():
                    if line.startswith("max "):
                        return int(line.split()[1])
        return 0

    def _freezer(self) -> tuple[Path, str, str] | None:
        """The freeze control file and its frozen/thawed values (v2 `cgroup.freeze`, v1 freezer)."""
        for p in self.paths:
            if (p / "cgroup.freeze").exists():
                return p / "cgroup.freeze", "1", "0"
            if (p / "freezer.state").exists():
                return p / "freezer.state", "FROZEN", "THAWED"
        return None

    @property
    def can_freeze(self) -> bool:
        return self._freezer() is not None

    def freeze(self, frozen: bool) -> bool:
        """Freeze (or thaw) every process of the job at once, whatever session it made for
        itself, and wait until the kernel says it is done; False where there is no freezer."""
        freezer = self._freezer()
        if freezer is None:
            return False
        path, on, off = freezer
        try:
            path.write_text(on if frozen else off)
            if frozen:  # v1 passes through FREEZING; v2 reports "frozen 1" in cgroup.events
                events = path.parent / "cgroup.events"
                for _ in range(200):
                    state = events.read_text() if events.exists() else path.read_text()
                    if ("frozen 1" in state) if events.exists() else state.strip() == "FROZEN":
                        break
                    time.sleep(0.001)
        except OSError:
            return False
        return True

    def pids(self) -> list[int]:
        for p in self.paths:
            try:
                return [int(x) for x in (p / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                continue
        return []

    def kill(self) -> None:
        """SIGKILL every process of the job (thawed first: a frozen v1 task does not die)."""
        self.freeze(False)
        for p in self.paths:
            if (p / "cgroup.kill").exists():
                try:
                    (p / "cgroup.kill").write_text("1")
                    return
                except OSError:
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def remove(self) -> None:
        self.freeze(False)
        for p in self.paths:
            for _ in range(50):
                try:
                    p.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        self.paths = []
