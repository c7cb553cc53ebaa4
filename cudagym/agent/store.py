"""The trajectory store of a run directory, crash-safe and resumable.

Layout::

    run.json                      the run's settings (written once; checked on resume)
    episodes/<episode_id>.jsonl   one completed episode: its step records, its
                                  {"type": "conversation", ...} record (the whole
                                  conversation and the tool schemas), then one
                                  {"type": "episode", ...} summary line
    episodes/<episode_id>.jsonl.partial   an episode in progress (steps appended as they happen)

An episode becomes complete by renaming its ``.partial`` file after the summary line is
written and fsynced: the rename is atomic, so a crash leaves either a complete episode file or
a ``.partial`` one. On resume, complete episodes are skipped and ``.partial`` files are deleted
(those episodes run again from the start), so no episode is lost or duplicated.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def episode_filename(episode_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", episode_id) + ".jsonl"


class EpisodeWriter:
    """Appends step records of one episode to its ``.partial`` file; `commit` completes it."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.partial = final.with_name(final.name + ".partial")
        self._fh = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 - closed in commit/abort

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, default=str) + "\n")
        self._fh.flush()

    def commit(self, summary: dict[str, Any]) -> None:
        self.write({"type": "episode", **summary})
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.partial, self.final)
        _fsync_dir(self.final.parent)

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.partial.unlink(missing_ok=True)


class TrajectoryStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.episodes_dir = self.root / "episodes"
        self.episodes_dir.mkdir(parents=True, exist_ok=True)

    # -- run settings --------------------------------------------------------------------------
    def read_settings(self) -> dict[str, Any] | None:
        p = self.root / "run.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def write_settings(self, settings: dict[str, Any]) -> None:
        tmp = self.root / "run.json.tmp"
        tmp.write_text(json.dumps(settings, indent=2, default=str))
        os.replace(tmp, self.root / "run.json")

    # -- episodes ------------------------------------------------------------------------------
    def path(self, episode_id: str) -> Path:
        return self.episodes_dir / episode_filename(episode_id)

    def is_complete(self, episode_id: str) -> bool:
        return self.path(episode_id).is_file()

    def clean_partials(self) -> list[str]:
        """Delete the files of episodes a crash interrupted; returns their names."""
        removed = []
        for p in sorted(self.episodes_dir.glob("*.partial")):
            p.unlink(missing_ok=True)
            removed.append(p.name[: -len(".partial")])
        return removed

    def begin(self, episode_id: str) -> EpisodeWriter:
        return EpisodeWriter(self.path(episode_id))

    def summaries(self) -> list[dict[str, Any]]:
        """The summary records of all complete episodes, sorted by episode id."""
        out = []
        for p in sorted(self.episodes_dir.glob("*.jsonl")):
            last = None
            with open(p, encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        last = line
            if last:
                rec = json.loads(last)
                if rec.get("type") == "episode":
                    out.append(rec)
        return sorted(out, key=lambda r: r.get("episode_id", ""))

    def conversation(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's "conversation" record (its whole conversation and tool schemas), or None
        for an episode recorded without one."""
        with open(self.path(episode_id), encoding="utf-8") as fh:
            for line in fh:
                if line.startswith('{"type": "conversation"'):
                    return json.loads(line)
        return None

    def steps(self, episode_id: str) -> list[dict[str, Any]]:
        with open(self.path(episode_id), encoding="utf-8") as fh:
            return [r for r in (json.loads(x) for x in fh if x.strip()) if r.get("type") == "step"]


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
