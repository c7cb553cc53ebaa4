"""`cudagym export sft`: a run's good episodes as supervised fine-tuning data.

The CUDA-L1 pipeline starts with supervised fine-tuning on validated solutions, then
self-training on the policy's own functional outputs; both are this export of a run directory.
Each kept episode becomes one row in the conversational format of TRL's `SFTTrainer` (tested:
its dataset preparation tokenizes it with a chat template; verl's multi-turn SFT dataset reads a
`messages` column too, not tested here):

- ``messages``: the whole conversation untrimmed, in the form the policy used — system, user
  (the task), then per turn an assistant message and the answers. A policy with native tool
  calls (``--tool-mode native``) has them as ``tool_calls`` in the OpenAI format (``{"id",
  "type": "function", "function": {"name", "arguments": <JSON string>}}``) answered by ``tool``
  messages (``tool_call_id``, ``content``); a policy that writes its calls in its text (the
  Hermes ``<tool_call>`` form of the scripted policy and ``--tool-mode hermes``) keeps them
  there, answered by a user message of ``<tool_response>`` blocks — the form its chat template
  renders;
- ``tools``: the tool schemas (OpenAI function format), for the chat template;
- ``metadata``: task id, episode id, the final verdict (milestone, reward, speedups, reasons),
  the solution's hash.

An episode is kept when its final verdict is correct (`ExportFilter.min_milestone`) and, if
asked, at least `min_speedup` times faster than eager. Episodes whose final solution files are
identical (same hash) are kept once: the first in episode-id order. Output: JSON lines (``.jsonl``)
or parquet (``.parquet``), by the file's suffix; `tools` and each message's `tool_calls` are kept
as JSON objects in JSON lines and as JSON strings in parquet (their schemas differ per tool).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cudagym.agent.store import TrajectoryStore
from cudagym.env.parsing import parse_action
from cudagym.errors import ConfigError

MILESTONES = ("correct", "faster_than_eager", "faster_than_compile")
# which verdict milestones satisfy each threshold (see cudagym.rewards.milestone)
_AT_LEAST = {"correct": {"correct", "faster_than_eager", "faster_than_compile"},
             "faster_than_eager": {"faster_than_eager", "faster_than_compile"},
             "faster_than_compile": {"faster_than_compile"}}


class ExportFilter(BaseModel):
    min_milestone: str = "correct"
    min_speedup: float | None = None  # over eager, on top of the milestone

    def keeps(self, verdict: dict[str, Any] | None) -> bool:
        if not verdict or not verdict.get("correct"):
            return False
        if verdict.get("milestone") not in _AT_LEAST[self.min_milestone]:
            return False
        speedup = verdict.get("speedup_vs_eager")
        return self.min_speedup is None or (speedup is not None and speedup >= self.min_speedup)


class ExportSummary(BaseModel):
    out: Path
    episodes: int  # complete episodes in the run
    kept: int
    duplicates: int  # kept episodes' solutions already exported
    without_conversation: int  # recorded before conversations were stored


def tool_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's tool calls as (name, arguments): its native `tool_calls`, or the
    ones written in its text (`<tool_call>` blocks, as the env parses them)."""
    if message.get("role") != "assistant":
        return []
    if message.get("tool_calls"):
        out = []
        for call in message["tool_calls"]:
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {}
            out.append((str(fn.get("name")), args if isinstance(args, dict) else {}))
        return out
    return [(c.name, c.arguments) for c in parse_action(message.get("content") or "").calls]


def solution_hash(messages: list[dict[str, Any]]) -> str:
    """The hash of the solution files as last written in the conversation (write_file calls)."""
    files: dict[str, str] = {}
    for m in messages:
        for name, args in tool_calls(m):
            if name == "write_file" and isinstance(args.get("path"), str):
                files[args["path"]] = str(args.get("content", ""))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + files[path].encode() + b"\0")
    return h.hexdigest()[:16]


def sft_rows(run_dir: Path, keep: ExportFilter) -> tuple[list[dict[str, Any]], ExportSummary]:
    """The rows of the export (see the module's text) and what was kept."""
    if keep.min_milestone not in _AT_LEAST:
        raise ConfigError(f"--min-milestone must be one of {', '.join(MILESTONES)}")
    store = TrajectoryStore(run_dir)
    if store.read_settings() is None:
        raise ConfigError(f"{run_dir} is not a run directory of `cudagym run` (no run.json)")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    summaries = store.summaries()
    duplicates = missing = 0
    for s in summaries:
        if not keep.keeps(s.get("verdict")):
            continue
        conv = store.conversation(s["episode_id"])
        if conv is None:
            missing += 1
            continue
        digest = solution_hash(conv["messages"])
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        v = s["verdict"]
        rows.append({
            "messages": conv["messages"],
            "tools": conv["tools"],
            "metadata": {"task_id": s["task_id"], "episode_id": s["episode_id"], "solution_hash": digest,
                         "milestone": v.get("milestone"), "reward": v.get("reward"),
                         "speedup_vs_eager": v.get("speedup_vs_eager"),
                         "speedup_vs_compile": v.get("speedup_vs_compile"),
                         "reasons": v.get("reasons") or [], "target": (s.get("task") or {}).get("target")},
        })
    return rows, ExportSummary(out=run_dir, episodes=len(summaries), kept=len(rows), duplicates=duplicates,
                               without_conversation=missing)


def export_sft(run_dir: Path, out: Path, keep: ExportFilter | None = None) -> ExportSummary:
    """Write the export of `run_dir` to `out` (.jsonl or .parquet); written whole, then renamed."""
    out = Path(out)
    if out.suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"{out}: the export is .jsonl or .parquet")
    rows, summary = sft_rows(Path(run_dir), keep or ExportFilter())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{"messages": [{**m, "tool_calls": json.dumps(m["tool_calls"])} if "tool_calls" in m else m
                              for m in r["messages"]],
                 "tools": json.dumps(r["tools"]), "metadata": json.dumps(r["metadata"])} for r in rows]
        pq.write_table(pa.Table.from_pylist(flat), tmp)
    tmp.replace(out)
    return summary.model_copy(update={"out": out})
