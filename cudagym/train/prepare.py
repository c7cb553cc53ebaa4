"""verl-format parquet (train/val) from any task source, with contamination filtering.

One row per task, the columns verl's `RLHFDataset` reads:

- ``prompt``: the chat messages (system prompt, task prompt) that verl's dataset filters by
  length; the agent loop re-creates the task prompt with ``env.reset`` and keeps this system prompt;
- ``data_source`` (the task's source), ``ability`` (``"kernel"``), ``reward_model``
  (``{"style": "env", "ground_truth": ""}``: the reward is the env's, no reference answer);
- ``agent_name``: ``cudagym_kernel``, the agent loop that plays the row;
- ``extra_info``: ``split``, ``index``, ``task_id``, ``source``, ``target``, ``bench_file``,
  ``bench_similarity`` and ``task_json`` (the whole task, so rollout workers need not see the
  source directory).

Contamination: a task whose nearest file of the eval set (`ReferenceIndex`, the corpus builder's
measure) scores at or above the threshold is dropped; the eval set is every ``--eval`` source,
and train rows are also checked against the val rows of this split, so no near-copy of a
validation task is trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from cudagym.errors import ConfigError
from cudagym.tasks.model import Target, Task
from cudagym.train import AGENT_NAME

ABILITY = "kernel"


class PrepareConfig(BaseModel):
    source: str  # "bundled", a bundled id, a .py file, a KernelBench dir, a corpus dir or .parquet
    out: Path
    val_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    val_source: str | None = None  # a separate validation source (then val_fraction is unused)
    eval_sources: list[str] = Field(default_factory=list)  # contamination reference sets
    threshold: float = Field(default=0.9, gt=0.0, le=1.0)
    target: Target = Target.CUDA  # the target the system prompt is written for
    mode: str = "strict"
    seed: int = 0
    limit: int | None = Field(default=None, ge=1)


class PrepareSummary(BaseModel):
    train: int
    val: int
    dropped: list[dict[str, Any]]  # {"task_id", "split", "nearest", "score"}
    files: dict[str, str]


def task_row(task: Task, split: str, index: int, target: Target, mode: str,
             bench_file: str | None = None, bench_similarity: float = 0.0) -> dict[str, Any]:
    """One verl row for `task` (see the module doc)."""
    from cudagym.agent.prompt import system_prompt
    from cudagym.env.prompt import task_prompt

    sized = task.for_target(target)
    return {
        "data_source": task.source,
        "prompt": [{"role": "system", "content": system_prompt(target.value, mode)},
                   {"role": "user", "content": task_prompt(sized, target)}],
        "ability": ABILITY,
        "reward_model": {"style": "env", "ground_truth": ""},
        "agent_name": AGENT_NAME,
        "extra_info": {"split": split, "index": index, "task_id": task.id, "source": task.source,
                       "target": target.value, "bench_file": bench_file or "",
                       "bench_similarity": float(bench_similarity), "task_json": task.model_dump_json()},
    }


def _load(spec: str) -> list[Task]:
    from cudagym.tasks.loaders import load_tasks

    try:
        return load_tasks(spec)
    except Exception as e:  # noqa: BLE001 - a bad source is the user's to fix: say which
        raise ConfigError(f"task source {spec!r}: {e}") from None


def prepare(cfg: PrepareConfig) -> PrepareSummary:
    """Write ``OUT/train.parquet`` and ``OUT/val.parquet``; returns counts and dropped tasks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cudagym.tasks.corpus.contamination import ReferenceIndex

    tasks = _load(cfg.source)
    if cfg.limit:
        tasks = tasks[: cfg.limit]
    if not tasks:
        raise ConfigError(f"task source {cfg.source!r} holds no tasks")
    if cfg.val_source:
        train, val = tasks, _load(cfg.val_source)
    else:
        order = list(tasks)
        random.Random(cfg.seed).shuffle(order)
        n_val = round(len(order) * cfg.val_fraction)
        if cfg.val_fraction > 0 and len(order) > 1:
            n_val = max(1, n_val)
        val, train = order[:n_val], order[n_val:]
    if not train:
        raise ConfigError("no training tasks left after the validation split")

    eval_files: dict[str, str] = {}
    for spec in cfg.eval_sources:
        eval_files.update({f"{spec}::{t.id}": t.code for t in _load(spec)})
    dropped: list[dict[str, Any]] = []

    def screen(items: list[Task], index: ReferenceIndex | None, split: str) -> list[tuple[Task, Any]]:
        kept = []
        for t in items:
            match = index.nearest(t.code) if index is not None and len(index) else None
            if match is not None and index is not None and index.is_contaminated(match):
                dropped.append({"task_id": t.id, "split": split, "nearest": match.file, "score": match.score})
            else:
                kept.append((t, match))
        return kept

    eval_index = ReferenceIndex(eval_files, threshold=cfg.threshold) if eval_files else None
    val_kept = screen(val, eval_index, "val")
    train_refs = {**eval_files, **{f"val::{t.id}": t.code for t, _ in val_kept}}
    train_index = ReferenceIndex(train_refs, threshold=cfg.threshold) if train_refs else None
    train_kept = screen(train, train_index, "train")
    if not train_kept:
        raise ConfigError("every training task was dropped as contaminated")

    cfg.out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, kept in (("train", train_kept), ("val", val_kept)):
        rows = [task_row(t, split, i, cfg.target, cfg.mode, m.file if m else None, m.score if m else 0.0)
                for i, (t, m) in enumerate(kept)]
        path = cfg.out / f"{split}.parquet"
        table = pa.Table.from_pylist(rows, schema=_schema())
        pq.write_table(table, path)
        files[split] = str(path)
    (cfg.out / "prepare.json").write_text(json.dumps(
        {"config": cfg.model_dump(mode="json"), "train": len(train_kept), "val": len(val_kept),
         "dropped": dropped}, indent=1))
    return PrepareSummary(train=len(train_kept), val=len(val_kept), dropped=dropped, files=files)


def _schema() -> Any:
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([
        ("data_source", pa.string()), ("prompt", pa.list_(msg)), ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("agent_name", pa.string()),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task_id", pa.string()),
                                  ("source", pa.string()), ("target", pa.string()), ("bench_file", pa.string()),
                                  ("bench_similarity", pa.float64()), ("task_json", pa.string())])),
    ])
