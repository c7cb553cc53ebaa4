"""What a build may read (`cudagym.sandbox.toolchain`): a private, bounded, read-only copy of a
workspace's declared sources, leaving out precompiled headers and anything that is not a regular
file, and the listing of its names that the build's key covers.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cudagym.sandbox.toolchain.cache import sha256_of

# -- what a build may read: a private copy of the declared sources ---------------------------

PCH_SUFFIXES = (".gch", ".pch")
PCH_MAGIC = (b"gpch", b"CPCH")  # GCC's and clang's precompiled headers begin with these
SKIPPED_DIRS = ("__pycache__",)  # Python's bytecode, which an import may write meanwhile


@dataclass
class SourceCopy:
    """The files of a workspace that a build may read, copied to `root` (same relative paths).

    `listing` hashes the names of every file copied (see the module docstring: existence matters);
    `left_out` names what was not copied and why; `error` is set when the copy is over its bounds."""

    root: Path
    listing: str = ""
    files: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    error: str | None = None


def copy_sources(workspace: Path, root: Path, dirs: tuple[str, ...] = ("kernels",), files: tuple[str, ...] = (),
                 *, max_bytes: int, max_files: int) -> SourceCopy:
    """Copy `workspace`'s `dirs` (recursively) and `files` to a fresh `root`, leaving out
    precompiled headers and anything that is not a regular file; read-only copies. Never follows
    a symlink and never opens a FIFO or a device."""
    out = SourceCopy(root)
    root.mkdir(parents=True)
    total = 0
    for rel in _candidates(workspace, dirs, files, out.left_out):
        if len(out.files) >= max_files:
            out.error = f"kernels/ holds more than {max_files} files; a build reads at most {max_files}"
            return out
        why, data = _read_source(workspace / rel, max_bytes - total)
        if why == "missing":
            continue
        if why:
            if why.startswith("over"):
                out.error = f"{rel}: the files under kernels/ hold more than {max_bytes >> 20} MiB; a build " \
                            f"reads at most that much"
                return out
            out.left_out.append(f"{rel} ({why})")
            continue
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        dest.chmod(0o444)
        total += len(data)
        out.files.append(rel)
    out.listing = sha256_of(*sorted(out.files))
    return out


def source_listing(workspace: Path, dirs: tuple[str, ...] = ("kernels",), files: tuple[str, ...] = ()) -> str:
    """`copy_sources(...).listing` without copying (bounds aside): the names it would copy."""
    names = []
    for rel in _candidates(workspace, dirs, files, []):
        why, _ = _read_source(workspace / rel, len(max(PCH_MAGIC, key=len)), head=True)
        if why is None:
            names.append(rel)
    return sha256_of(*sorted(names))


def _candidates(workspace: Path, dirs: tuple[str, ...], files: tuple[str, ...], left_out: list[str]) -> list[str]:
    """`files` and the files under `dirs` (not under symlinked, `__pycache__` or `.gch` directories,
    which go to `left_out`), relative to `workspace`, sorted."""
    wanted: list[str] = list(files)
    for d in dirs:
        top = workspace / d
        if top.is_symlink() or not top.is_dir():
            continue
        for cur, subdirs, names in os.walk(top, followlinks=False):
            rel_dir = Path(cur).relative_to(workspace).as_posix()
            subdirs.sort()
            for sd in list(subdirs):
                path = Path(cur) / sd
                if sd in SKIPPED_DIRS:
                    subdirs.remove(sd)
                elif path.is_symlink() or sd.endswith(PCH_SUFFIXES):
                    subdirs.remove(sd)
                    left_out.append(f"{rel_dir}/{sd}/ ({'a symlink' if path.is_symlink() else 'precompiled headers'})")
            wanted.extend(f"{rel_dir}/{n}" for n in sorted(names))
    return wanted


def _read_source(path: Path, room: int, head: bool = False) -> tuple[str | None, bytes]:
    """(why it is left out, or None; its bytes) for one file of a source copy (`head`: only its
    first `room` bytes are wanted)."""
    if path.name.endswith(PCH_SUFFIXES):
        return "a precompiled header", b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "missing", b""
    except OSError:
        return "not a regular file", b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", b""
        if st.st_size > room and not head:
            return "over", b""
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(room + 1)
    finally:
        os.close(fd)
    if len(data) > room and not head:
        return "over", b""
    if data.startswith(PCH_MAGIC):
        return "a precompiled header", b""
    return None, data
