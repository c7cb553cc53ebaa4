"""Contrastive feedback (the CUDA-L1 recipe): earlier variants of a task's solution, with what
they measured, shown to the policy before it writes the next one.

A *variant* is the workspace's solution files (``model_new.py`` and ``kernels/*``) at the moment
a ``profile`` or ``submit`` measured them, with the speedups and the verdict's reasons. A
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
import re
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from cudagym.errors import WorkspaceError
from cudagym.sandbox.workspace import Workspace

ANALYSIS_TAG = "analysis"
_ANALYSIS = re.compile(r"<analysis>\s*(\S.*?)</analysis>", re.DOTALL)
_TOOL_START = re.compile(r"<tool_call>|^\s*\{", re.MULTILINE)


class ContrastiveConfig(BaseModel):
    """Contrastive feedback of `KernelEnv` (off while `keep` is 0)."""

    keep: int = Field(default=0, ge=0)  # earlier variants shown, best first
    in_episode: bool = True  # also list the episode's variants after each profile
    require_analysis: bool = False  # ask for <analysis>...</analysis> before each turn's tool call
    analysis_reward: float = 0.0  # shaping, paid once per episode for the first turn that has one
    max_variant_chars: int = Field(default=4000, ge=200)  # per variant's code in the prompt
    book: Path | None = None  # a JSON-lines file that keeps the variants across runs (None: in memory)


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

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()[:16]

    def rank(self) -> tuple[bool, float]:
        return self.correct, self.speedup_vs_eager or 0.0


class VariantBook:
    """Variants per task (see the module's text). Thread-safe; one file per book."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else None
        self._by_task: dict[str, dict[str, Variant]] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    self._keep(Variant.model_validate_json(line))
                except ValueError:
                    continue  # a line cut short by a crash

    def _keep(self, v: Variant) -> bool:
        seen = self._by_task.setdefault(v.task_id, {})
        old = seen.get(v.digest)
        if old is not None and old.rank() >= v.rank():
            return False
        seen[v.digest] = v
        return True

    def add(self, v: Variant) -> None:
        """Record `v` (the same files measured again keep their better measurement)."""
        with self._lock:
            if self._keep(v) and self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(v.model_dump_json() + "\n")

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
            lines.extend(f"- {r}" for r in v.reasons[:4])
            budget = max_chars
            for name in sorted(v.files, key=lambda n: (n != "model_new.py", n)):
                text = v.files[name]
                if budget <= 0:
                    lines.append(f"({name} not shown: over the length limit)")
                    continue
                shown = text if len(text) <= budget else text[:budget] + f"\n... ({len(text) - budget} more characters)"
                budget -= len(shown)
                lines.append(f"{name}:\n```\n{shown.rstrip()}\n```")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)


def solution_files(workspace: Workspace) -> dict[str, str]:
    """The solution's own files in a workspace: every file but the reference (text only)."""
    out: dict[str, str] = {}
    for rel in workspace.list():
        if rel != "model.py":
            try:
                out[rel] = workspace.read(rel)
            except (OSError, UnicodeDecodeError, WorkspaceError):
                continue
    return out


def has_analysis(text: str) -> bool:
    """Whether a turn's text holds a non-empty <analysis>...</analysis> before its first tool call."""
    m = _ANALYSIS.search(text or "")
    if not m:
        return False
    call = _TOOL_START.search(text)
    return call is None or m.start() < call.start()


def variant_from_result(task_id: str, episode: str, turn: int, files: dict[str, str],
                        data: dict[str, Any]) -> Variant | None:
    """A variant from a profile or submit tool result's data (None if it measured nothing)."""
    if "profile" in data:
        p = data["profile"]
        if not p.get("ok"):
            return None
        return Variant(task_id=task_id, episode=episode, turn=turn, files=files, correct=True,
                       speedup_vs_eager=p.get("speedup_vs_eager"), speedup_vs_compile=p.get("speedup_vs_compile"),
                       reasons=list(p.get("reasons") or []))
    if "verdict" in data:
        v = data["verdict"]
        return Variant(task_id=task_id, episode=episode, turn=turn, files=files, correct=bool(v.get("correct")),
                       speedup_vs_eager=v.get("speedup_vs_eager"), speedup_vs_compile=v.get("speedup_vs_compile"),
                       milestone=str(v.get("milestone") or ""), reasons=list(v.get("reasons") or []))
    return None


def analysis_instruction() -> str:
    return ("Before each turn's tool call, write a performance analysis inside <analysis>...</analysis>: "
            "which variant so far was fastest and why, and what you will change next.")
