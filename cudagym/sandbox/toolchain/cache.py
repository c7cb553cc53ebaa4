"""The build cache's bound and keys (`cudagym.sandbox.toolchain`): least-recently-used eviction
of objects, artifacts and inline modules (`CacheBound`), the removal of one entry, and the
length-prefixed sha256 that every key is made of.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path


def sha256_of(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# -- the cache's bound --------------------------------------------------------------------------


class CacheBound:
    """Keeps a build cache's entries (objects/<key>/<variant>, artifacts/<key>,
    inline/<key>/<variant>) under `max_bytes` by evicting the least recently used (an entry's
    directory mtime, set when it is stored or used: `touch`). Entries used in the last `grace_s`
    are kept while that leaves the cache within `max_bytes + slack_bytes` (`slack_bytes`: what
    one build may add); past that the least recently used go whatever their age, except those
    `enforce(keep=...)` names (the build's own library). So the grace period can keep the cache
    over its bound by at most `slack_bytes` plus what `keep` holds. A scan of the cache is skipped
    while this process's running total (the last scan plus what it stored since,
    `enforce(added)`) is under the bound, for at most `rescan_s` (other processes store too)."""

    LAYOUT = (("objects", 2), ("artifacts", 1), ("inline", 2))  # (subdirectory, depth of an entry)

    def __init__(self, root: Path, max_bytes: int, grace_s: float, rescan_s: float = 60.0,
                 slack_bytes: int = 256 << 20) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.slack_bytes = slack_bytes
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes at the last scan, plus what was stored since
        self._scanned = 0.0

    @staticmethod
    def touch(entry: Path) -> None:
        try:
            os.utime(entry)
        except OSError:  # a read-only view of the cache (a candidate's job): nothing to record
            pass

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry."""
        out = []
        for sub, depth in self.LAYOUT:
            level = [self.root / sub]
            for _ in range(depth):
                level = [c for d in level if d.is_dir() for c in d.iterdir() if not c.name.startswith(".")]
            for e in level:
                try:
                    size = sum(f.stat().st_size for f in e.rglob("*") if f.is_file())
                    out.append((e.stat().st_mtime, size, e))
                except OSError:
                    continue
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    @staticmethod
    def size_of(*entries: Path | None) -> int:
        return sum(f.stat().st_size for e in entries if e is not None and e.is_dir() for f in e.rglob("*")
                   if f.is_file())

    def enforce(self, added: int | None = None, keep: tuple[Path | None, ...] = ()) -> list[Path]:
        """Evict least recently used entries until the cache is under its bound; the evicted.
        `added`: the bytes this process just stored, when known; `keep`: entries never evicted
        now (see the class docstring)."""
        with self._lock:
            now = time.time()
            if (added is not None and self._total is not None and self._total + added <= self.max_bytes
                    and now - self._scanned < self.rescan_s):
                self._total += added
                return []
            entries = sorted(self.entries(), key=lambda e: e[0])
            total = sum(size for _, size, _ in entries)
            kept = {Path(k) for k in keep if k is not None}
            evicted: list[Path] = []
            # first past entries out of their grace period; then, while the cache is over its
            # bound by more than one build's output, the graced ones too
            for limit, graced in ((self.max_bytes, False), (self.max_bytes + self.slack_bytes, True)):
                for used, size, path in entries:
                    if total <= limit:
                        break
                    if path in kept or path in evicted or (not graced and now - used < self.grace_s):
                        continue
                    remove_entry(path)
                    evicted.append(path)
                    total -= size
                    if path.parent.name not in ("objects", "artifacts", "inline"):
                        try:
                            path.parent.rmdir()  # a key left without variants
                        except OSError:
                            pass
            self._total, self._scanned = total, now
            return evicted


def remove_entry(path: Path) -> None:
    """Remove a cache entry (its files are read-only; its directories are not)."""
    tmp = path.with_name(f".evict-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, tmp)  # gone from lookups at once
    except OSError:
        return
    shutil.rmtree(tmp, ignore_errors=True)
