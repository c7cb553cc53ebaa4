"""Isolation primitives of the local sandbox, each used where the OS allows it.

- Writes: Landlock (Linux >= 5.13) confines file creation/modification to the workspace and a
  few device files; it needs no privileges and cannot be undone by the sandboxed process.
- Processes: the pids cgroup (v2, or v1 as on some VMs) caps processes+threads of a job.
  Root ignores RLIMIT_NPROC, so an rlimit alone would not stop a fork bomb.
- Memory: RLIMIT_AS on the CPU target; on CUDA (whose context reserves huge virtual ranges) a
  resident-memory watchdog in the parent, plus the memory cgroup where it exists.
- Network: the worker starts in its own network namespace (`unshare --net`).
- Everything: a PID namespace whose init is the worker, so killing it kills every descendant.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import uuid
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

    def __init__(self, max_pids: int, memory_mb: int | None):
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

    def remove(self) -> None:
        for p in self.paths:
            for _ in range(50):
                try:
                    p.rmdir()
                    break
                except OSError:
                    import time

                    time.sleep(0.02)
        self.paths = []
