"""`WorkspaceSnapshot`: a workspace's candidate files, shipped to an evaluator actor.

An actor may run on another node, so it cannot read the episode's workspace directory. The
client sends what the candidate wrote (``model_new.py`` and ``kernels/``; not ``model.py``,
which the harness takes from the `Task`, nor the ``.build`` scratch) and the actor materializes
it into a fresh directory of its own for the one call. The build caches are content-addressed
with workspace-relative paths, so a fresh directory per call still hits them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cudagym.errors import WorkspaceError
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Task

MAX_SNAPSHOT_BYTES = 64 << 20


@dataclass(frozen=True)
class WorkspaceSnapshot:
    files: dict[str, bytes]  # workspace-relative POSIX path -> content

    @classmethod
    def of(cls, workspace: Workspace) -> WorkspaceSnapshot:
        files: dict[str, bytes] = {}
        total = 0
        for rel in workspace.list():
            if rel == "model.py":
                continue
            data = workspace.resolve(rel).read_bytes()
            total += len(data)
            if total > MAX_SNAPSHOT_BYTES:
                raise WorkspaceError(f"the workspace holds more than {MAX_SNAPSHOT_BYTES >> 20} MB of files")
            files[rel] = data
        return cls(files)

    @contextmanager
    def materialized(self, parent: Path, task: Task) -> Iterator[Workspace]:
        """A workspace for `task` holding these files under a fresh directory of `parent`,
        removed on exit."""
        parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="ws-", dir=parent))
        try:
            ws = Workspace.create(root, task)
            for rel, data in self.files.items():
                path = ws.resolve(rel)  # refuses absolute paths and '..'
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            yield ws
        finally:
            shutil.rmtree(root, ignore_errors=True)
