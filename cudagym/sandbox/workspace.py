"""The per-episode workspace: the files a candidate solution is made of.

Layout (CUDA-Agent style)::

    model.py        the reference (read-only to the candidate; the harness never reads it back,
                    it takes the reference from the Task)
    model_new.py    defines `ModelNew`
    kernels/        *.cu / *.cpp kernels with extern "C" launchers, *_binding.cpp torch bindings,
                    *.h / *.cuh headers
    .build/         build scratch of the compile tool (not the candidate's to edit)

Only `model_new.py` and files under `kernels/` are writable through this API.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from cudagym.errors import WorkspaceError
from cudagym.tasks.model import Task

MAX_FILE_BYTES = 512 * 1024
WRITABLE_FILES = ("model_new.py",)
WRITABLE_DIRS = ("kernels",)
SOURCE_SUFFIXES = (".cu", ".cpp", ".cc", ".c", ".h", ".hpp", ".cuh")


class Workspace:
    """A directory holding one candidate solution; all paths are relative to `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise WorkspaceError(f"workspace {self.root} does not exist")

    @classmethod
    def create(cls, root: str | os.PathLike[str], task: Task, model_new: str | None = None) -> Workspace:
        """Make a fresh workspace for `task` (an existing `root` must be empty or a workspace)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / "kernels").mkdir(exist_ok=True)
        ref = root / "model.py"
        if ref.exists():
            ref.chmod(stat.S_IRUSR | stat.S_IWUSR)
        ref.write_text(task.code)
        ref.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        if model_new is not None:
            (root / "model_new.py").write_text(model_new)
        return cls(root)

    @classmethod
    def from_solution(cls, root: str | os.PathLike[str], task: Task, solution: str | os.PathLike[str]) -> Workspace:
        """A workspace for `task` holding `solution`: a workspace directory or a single `model_new.py`."""
        solution = Path(solution)
        ws = cls.create(root, task)
        if solution.is_dir():
            if not (solution / "model_new.py").is_file():
                raise WorkspaceError(f"solution directory {solution} has no model_new.py")
            shutil.copy2(solution / "model_new.py", ws.root / "model_new.py")
            if (solution / "kernels").is_dir():
                shutil.copytree(solution / "kernels", ws.root / "kernels", dirs_exist_ok=True)
        elif solution.is_file():
            shutil.copy2(solution, ws.root / "model_new.py")
        else:
            raise WorkspaceError(f"solution {solution} does not exist")
        return ws

    # -- paths -------------------------------------------------------------------------------
    def resolve(self, rel: str, *, for_write: bool = False) -> Path:
        """The absolute path of `rel`, refusing traversal, absolute paths and read-only files."""
        if not rel or "\x00" in rel:
            raise WorkspaceError("empty or invalid path")
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts:
            raise WorkspaceError(f"path {rel!r} must be relative to the workspace, without '..'")
        path = (self.root / pure).resolve()
        if path != self.root and self.root not in path.parents:
            raise WorkspaceError(f"path {rel!r} leaves the workspace")
        if for_write:
            parts = path.relative_to(self.root).parts
            ok = (len(parts) == 1 and parts[0] in WRITABLE_FILES) or (len(parts) >= 2 and parts[0] in WRITABLE_DIRS)
            if not ok:
                raise WorkspaceError(
                    f"{rel!r} is not writable: only model_new.py and files under kernels/ may be written"
                )
        return path

    # -- file operations ---------------------------------------------------------------------
    def read(self, rel: str) -> str:
        path = self.resolve(rel)
        if not path.is_file():
            raise WorkspaceError(f"no such file: {rel}")
        if path.stat().st_size > MAX_FILE_BYTES * 4:
            raise WorkspaceError(f"{rel} is too large to read ({path.stat().st_size} bytes)")
        return path.read_text(errors="replace")

    def write(self, rel: str, content: str) -> Path:
        data = content.encode()
        if len(data) > MAX_FILE_BYTES:
            raise WorkspaceError(f"refusing to write {len(data)} bytes to {rel}: the limit is {MAX_FILE_BYTES}")
        path = self.resolve(rel, for_write=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def edit(self, rel: str, old: str, new: str) -> Path:
        """Replace the one exact occurrence of `old` with `new` in `rel`."""
        path = self.resolve(rel, for_write=True)
        text = self.read(rel)
        count = text.count(old) if old else 0
        if count != 1:
            raise WorkspaceError(
                f"edit of {rel}: the text to replace occurs {count} times; it must occur exactly once"
            )
        return self.write(rel, text.replace(old, new, 1)) and path

    def list(self) -> list[str]:
        """Relative paths of the workspace's files (build scratch excluded), sorted."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not rel.parts[0].startswith("."):
                out.append(rel.as_posix())
        return out

    SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp", ".inl")

    def source_digest(self) -> str:
        """A digest of the workspace's source files (code a build or `model_new.py` may read; build
        scratch excluded): equal before and after a job unless the job rewrote the solution. Files
        over 16 MiB count by size and mtime."""
        h = hashlib.sha256()
        for rel in self.list():
            path = self.root / rel
            if path.suffix not in self.SOURCE_SUFFIXES or path.is_symlink():
                continue
            st = path.stat()
            h.update(f"{rel}\0{st.st_size}\0".encode())
            if st.st_size <= 16 << 20:
                h.update(hashlib.sha256(path.read_bytes()).digest())
            else:
                h.update(str(st.st_mtime_ns).encode())
        return h.hexdigest()

    def kernel_sources(self) -> builtins.list[Path]:  # `list` here is the method above
        """Compilable sources under kernels/ (headers excluded), sorted."""
        kdir = self.root / "kernels"
        if not kdir.is_dir():
            return []
        return sorted(p for p in kdir.rglob("*") if p.is_file() and p.suffix in (".cu", ".cpp", ".cc", ".c"))

    @property
    def model_new(self) -> Path:
        return self.root / "model_new.py"

    @property
    def build_dir(self) -> Path:
        d = self.root / ".build"
        d.mkdir(exist_ok=True)
        return d
