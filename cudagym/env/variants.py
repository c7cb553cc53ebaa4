"""Contrastive feedback (the CUDA-L1 recipe): earlier variants of a task's solution, with what
they measured, shown to the policy before it writes the next one.

A *variant* is the workspace's solution files (``model_new.py`` and ``kernels/*``) that a
``profile`` or ``submit`` measured, with the speedups and the verdict's reasons. The files are
read (`snapshot_files`) before the tool's jobs run: a job runs the candidate's code, which may
rewrite its workspace, so the workspace as it is afterwards is never what was measured.

Everything is bounded (`BookLimits`): the files of one variant (a file over `max_file_bytes`, past
`max_files` or past `max_variant_bytes` is left out and named), the variants kept per task (the
lowest ranked go first) and in all (`max_book_bytes`), the book's file (rewritten with what is
kept when it grows past twice that), and the prompt's excerpt (`render`). A
`VariantBook` keeps them per task: in memory for one env, shared between envs (a trainer's
rollout workers on one host), or in an append-only JSON-lines file that survives the process
(and is read back when the book is opened again). `render` writes the best `k` of a task, fastest
correct first, as the block that `KernelEnv` puts in the task prompt of each new episode (a
*round*) and, with `ContrastiveConfig.in_episode`, after every profile.

The policy can be asked to begin each turn with a performance analysis (which variant was
fastest and why) before its tool call (`ContrastiveConfig.require_analysis`): `has_analysis`
checks for it, and the env's shaping reward can pay for its presence.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from pathlib import Path
from collections.abc import Iterator
from typing import IO, Any

from pydantic import BaseModel, Field

from cudagym.sandbox.workspace import SOURCE_SUFFIXES, Workspace

_ANALYSIS = re.compile(r"<analysis>\s*(\S.*?)</analysis>", re.DOTALL)
_TOOL_START = re.compile(r"<tool_call>|^\s*\{", re.MULTILINE)


class BookLimits(BaseModel):
    """What a variant and the book may hold (see the module's text)."""

    max_file_bytes: int = Field(default=64 * 1024, ge=1)  # a larger file is left out of the variant
    max_files: int = Field(default=32, ge=1)
    max_variant_bytes: int = Field(default=256 * 1024, ge=1)  # the files of one variant, together
    max_variants_per_task: int = Field(default=64, ge=1)
    max_book_bytes: int = Field(default=32 << 20, ge=1)  # every variant kept, together
    max_reason_chars: int = Field(default=500, ge=20)  # per reason kept


class ContrastiveConfig(BaseModel):
    """Contrastive feedback of `KernelEnv` (off while `keep` is 0)."""

    keep: int = Field(default=0, ge=0)  # earlier variants shown, best first
    in_episode: bool = True  # also list the episode's variants after each profile
    require_analysis: bool = False  # ask for <analysis>...</analysis> before each turn's tool call
    analysis_reward: float = 0.0  # shaping, paid once per episode for the first turn that has one
    max_variant_chars: int = Field(default=4000, ge=200)  # per variant's code in the prompt
    book: Path | None = None  # a JSON-lines file that keeps the variants across runs (None: in memory)
    limits: BookLimits = Field(default_factory=BookLimits)


class Variant(BaseModel):
    """One measured solution of a task."""

    task_id: str
    episode: str = ""
    turn: int = 0
    files: dict[str, str]  # relative path → text (model_new.py, kernels/*)
    correct: bool
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    milestone: str = ""
    reasons: list[str] = Field(default_factory=list)
    left_out: list[str] = Field(default_factory=list)  # files not recorded, and why

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()[:16]

    def rank(self) -> tuple[bool, float]:
        return self.correct, self.speedup_vs_eager or 0.0

    def size(self) -> int:
        """Bytes it holds (files and reasons), as the book counts them."""
        return sum(len(k) + len(t.encode()) for k, t in self.files.items()) + sum(len(r) for r in self.reasons)


class MeasuredFiles(BaseModel):
    """The solution files a tool's jobs measured, read before they ran (`snapshot_files`)."""

    files: dict[str, str] = Field(default_factory=dict)
    left_out: list[str] = Field(default_factory=list)
    digests: dict[str, str] = Field(default_factory=dict)  # every solution file's sha256, left out or not

    def changed_in(self, workspace: Workspace) -> list[str]:
        """The solution files that differ in `workspace` now (written, removed or added)."""
        now = _digests(workspace)
        return sorted(n for n in set(now) | set(self.digests) if now.get(n) != self.digests.get(n))


MAX_LEFT_OUT_NAMED = 10


def _solution_names(workspace: Workspace) -> list[str]:
    """The solution's files, in the order a variant takes them: model_new.py, the kernels'
    sources and headers, then the rest (a flood of other files cannot push the code out)."""
    names = [rel for rel in workspace.list() if rel != "model.py"]
    return sorted(names, key=lambda n: (n != "model_new.py", not n.endswith(SOURCE_SUFFIXES), n))


def _read_regular(path: Path, limit: int) -> bytes | None:
    """At most `limit` + 1 bytes of a regular file (never a FIFO or a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit + 1)
    finally:
        os.close(fd)


def _digests(workspace: Workspace) -> dict[str, str]:
    out = {}
    for rel in _solution_names(workspace):
        h = hashlib.sha256()
        try:
            fd = os.open(workspace.root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            out[rel] = "unreadable"
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                while chunk := os.read(fd, 1 << 20):
                    h.update(chunk)
                out[rel] = h.hexdigest()
            else:
                out[rel] = "not a regular file"
        finally:
            os.close(fd)
    return out


def snapshot_files(workspace: Workspace, limits: BookLimits | None = None) -> MeasuredFiles:
    """The solution's own files (every file but the reference; text only) within `limits`:
    what a variant records. Take it before the jobs that measure them run."""
    lim = limits or BookLimits()
    snap = MeasuredFiles(digests=_digests(workspace))
    total = 0
    left: list[str] = []
    for rel in _solution_names(workspace):
        if len(snap.files) >= lim.max_files:
            left.append(f"{rel} (over {lim.max_files} files)")
            continue
        data = _read_regular(workspace.root / rel, lim.max_file_bytes)
        if data is None:
            left.append(f"{rel} (not a regular file)")
        elif len(data) > lim.max_file_bytes:
            left.append(f"{rel} (over the limit of {lim.max_file_bytes} bytes per file)")
        elif total + len(data) > lim.max_variant_bytes:
            left.append(f"{rel} (over the limit of {lim.max_variant_bytes} bytes per variant)")
        else:
            try:
                snap.files[rel] = data.decode()
                total += len(data)
            except UnicodeDecodeError:
                left.append(f"{rel} (not text)")
    snap.left_out = _some(left)
    return snap


def _some(left: list[str]) -> list[str]:
    """At most `MAX_LEFT_OUT_NAMED` names, and how many more (entries such as "and 9 more files"
    already there count as one)."""
    if len(left) <= MAX_LEFT_OUT_NAMED + 1:
        return left
    return left[:MAX_LEFT_OUT_NAMED] + [f"and {len(left) - MAX_LEFT_OUT_NAMED} more files"]


def bounded(v: Variant, lim: BookLimits) -> Variant:
    """`v` within `lim`: files over the limits left out (named), reasons shortened."""
    files: dict[str, str] = {}
    left = [x[:300] for x in v.left_out[: MAX_LEFT_OUT_NAMED + 1]]
    total = 0
    for name in sorted(v.files, key=lambda n: (n != "model_new.py", n)):
        size = len(v.files[name].encode())
        if len(files) >= lim.max_files or size > lim.max_file_bytes or total + size > lim.max_variant_bytes:
            left.append(f"{name[:200]} (over the book's limits)")
            continue
        files[name] = v.files[name]
        total += size
    reasons = [r if len(r) <= lim.max_reason_chars else r[: lim.max_reason_chars] + " ..." for r in v.reasons[:8]]
    return v.model_copy(update={"files": files, "reasons": reasons, "left_out": _some(left),
                                "milestone": v.milestone[:100], "task_id": v.task_id[:200],
                                "episode": v.episode[:200]})


class VariantBook:
    """Variants per task (see the module's text), within `limits`. Thread-safe; one file per
    book (one process appends to it: a rewrite keeps what this process holds)."""

    def __init__(self, path: Path | None = None, limits: BookLimits | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.limits = limits or BookLimits()
        self._by_task: dict[str, dict[str, Variant]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            max_line = 4 * self.limits.max_variant_bytes + 64 * 1024  # JSON escapes at most ~4x (\uXXXX: 6x, rare)
            skipped: list[int] = []
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                for line in _lines(fh, max_line, skipped):
                    try:
                        self._keep(Variant.model_validate_json(line))
                    except ValueError:
                        continue  # a line cut short by a crash
            if skipped or self.path.stat().st_size > 2 * self.limits.max_book_bytes:
                self._rewrite()

    @property
    def total_bytes(self) -> int:
        """What the variants kept hold, as `Variant.size` counts it."""
        return self._bytes

    def _keep(self, v: Variant) -> Variant | None:
        """Keep `v` (bounded); the variant kept, or None when it was not (a better measurement
        of the same files is kept, or it ranks below all that its task may keep)."""
        v = bounded(v, self.limits)
        seen = self._by_task.setdefault(v.task_id, {})
        old = seen.get(v.digest)
        if old is not None and old.rank() >= v.rank():
            return None
        if old is not None:
            self._bytes -= old.size()
        seen[v.digest] = v
        self._bytes += v.size()
        while len(seen) > self.limits.max_variants_per_task:
            self._drop(v.task_id)
        while self._bytes > self.limits.max_book_bytes:
            self._drop(max(self._by_task, key=lambda t: len(self._by_task[t])))
        return v if self._by_task.get(v.task_id, {}).get(v.digest) is v else None

    def _drop(self, task_id: str) -> None:
        """Forget the lowest ranked variant of `task_id` (of equals, the earliest recorded)."""
        seen = self._by_task[task_id]
        worst = min(seen, key=lambda d: seen[d].rank())
        self._bytes -= seen.pop(worst).size()
        if not seen:
            del self._by_task[task_id]

    def add(self, v: Variant) -> None:
        """Record `v` (the same files measured again keep their better measurement)."""
        with self._lock:
            kept = self._keep(v)
            if kept is not None and self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(kept.model_dump_json() + "\n")
                if self.path.stat().st_size > 2 * self.limits.max_book_bytes:
                    self._rewrite()

    def _rewrite(self) -> None:
        """Replace the book's file by the variants kept (atomically)."""
        assert self.path is not None  # noqa: S101
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for seen in self._by_task.values():
                for v in seen.values():
                    fh.write(v.model_dump_json() + "\n")
        os.replace(tmp, self.path)

    def best(self, task_id: str, k: int, episode: str | None = None) -> list[Variant]:
        """The best `k` variants of `task_id` (of one episode if given): correct ones first,
        fastest first."""
        with self._lock:
            pool = [v for v in self._by_task.get(task_id, {}).values() if episode is None or v.episode == episode]
        return sorted(pool, key=Variant.rank, reverse=True)[:k]

    def render(self, task_id: str, k: int, max_chars: int, episode: str | None = None,
               title: str = "Earlier variants of this task") -> str:
        """The block shown to the policy ('' without variants)."""
        chosen = self.best(task_id, k, episode)
        if not chosen:
            return ""
        parts = [f"{title}, best first (speedups are over eager PyTorch and torch.compile, as measured):"]
        for i, v in enumerate(chosen, 1):
            speed = ", ".join(f"{x:.3f}x vs {name}" for name, x in (("eager", v.speedup_vs_eager),
                                                                      ("torch.compile", v.speedup_vs_compile))
                              if x is not None) or "no timing"
            head = f"### Variant {i}: {'correct' if v.correct else 'NOT correct'}, {speed}"
            if v.milestone:
                head += f", milestone {v.milestone}"
            lines = [head]
            lines.extend(f"- {r[:self.limits.max_reason_chars]}" for r in v.reasons[:4])
            if v.left_out:
                lines.append("(not recorded: " + ", ".join(v.left_out) + ")")
            budget = max_chars
            for name in sorted(v.files, key=lambda n: (n != "model_new.py", n)):
                text = v.files[name]
                if budget <= 0:
                    lines.append(f"({name} not shown: over the length limit)")
                    continue
                shown = text if len(text) <= budget else text[:budget] + f"\n... ({len(text) - budget} more characters)"
                budget -= len(shown)
                fence = "`" * max(3, longest_backtick_run(shown) + 1)  # the file cannot close it
                lines.append(f"{name}:\n{fence}\n{shown.rstrip()}\n{fence}")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)


def _lines(fh: IO[str], max_len: int, skipped: list[int]) -> Iterator[str]:
    """The lines of `fh`, skipping any longer than `max_len` characters without holding it (the
    number of each line skipped goes to `skipped`)."""
    n = 0
    while True:
        line = fh.readline(max_len + 1)
        if not line:
            return
        n += 1
        if len(line) > max_len and not line.endswith("\n"):
            skipped.append(n)
            while (rest := fh.readline(1 << 20)) and not rest.endswith("\n"):
                pass
            continue
        yield line


def has_analysis(text: str) -> bool:
    """Whether a turn's text holds a non-empty <analysis>...</analysis> before its first tool call."""
    m = _ANALYSIS.search(text or "")
    if not m:
        return False
    call = _TOOL_START.search(text)
    return call is None or m.start() < call.start()


def variant_from_result(task_id: str, episode: str, turn: int, measured: MeasuredFiles,
                        data: dict[str, Any]) -> Variant | None:
    """A variant of the files `measured` from a profile or submit tool result's data (None if
    it measured nothing)."""
    files, left_out = measured.files, measured.left_out
    if "profile" in data:
        p = data["profile"]
        if not p.get("ok"):
            return None
        return Variant(task_id=task_id, episode=episode, turn=turn, files=files, left_out=left_out, correct=True,
                       speedup_vs_eager=p.get("speedup_vs_eager"), speedup_vs_compile=p.get("speedup_vs_compile"),
                       reasons=list(p.get("reasons") or []))
    if "verdict" in data:
        v = data["verdict"]
        return Variant(task_id=task_id, episode=episode, turn=turn, files=files, left_out=left_out,
                       correct=bool(v.get("correct")),
                       speedup_vs_eager=v.get("speedup_vs_eager"), speedup_vs_compile=v.get("speedup_vs_compile"),
                       milestone=str(v.get("milestone") or ""), reasons=list(v.get("reasons") or []))
    return None


def analysis_instruction() -> str:
    return ("Before each turn's tool call, write a performance analysis inside <analysis>...</analysis>: "
            "which variant so far was fastest and why, and what you will change next.")


def longest_backtick_run(text: str) -> int:
    """The longest run of backticks in `text` (a code fence around it must be longer)."""
    return max((len(m) for m in re.findall(r"`+", text)), default=0)
