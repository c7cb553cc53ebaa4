"""What ``cudagym train`` runs inside verl's Ray job: the task runner and the training step's metrics.

- `KernelTaskRunner` / `KernelTaskRunnerV0`: verl's own task runners (``main_ppo.TaskRunnerV1``,
  ``main_ppo_v0.TaskRunner``), which first start the run's one evaluation pool
  (`shared_pool`: named, on the evaluation GPUs, `cudagym.train.settings`) and stop it when
  training ends. They start it before verl places its workers, and it lives exactly as long as
  the run; every agent-loop worker connects to it by name (`cudagym.train.verl_loop`).
- `KernelTrainer` (verl v1 trainer mode ``cudagym_sync``, the stage configs' default): verl's
  synchronous trainer whose step metrics also hold the episodes' outcomes (`episode_metrics`:
  pass rate, speedups, turns, tool errors, ...), read from the ``reward_extra_info`` that each
  episode put into verl's TransferQueue. verl itself logs those only with validation.

Importing this module registers ``cudagym_sync`` with verl; the task runner's process imports
it (Ray unpickles `KernelTaskRunner` by reference), which is where verl looks the trainer up.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import ray
from omegaconf import DictConfig, OmegaConf
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.main_ppo_v0 import TaskRunner
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from cudagym.train.settings import TRAINER_MODE, RunSettings, check_cluster


def episode_metrics(infos: Sequence[dict[str, Any] | None], prefix: str = "episode/") -> dict[str, float]:
    """The training step's view of its episodes, from each one's ``reward_extra_info``
    (`cudagym.train.verl_loop.METRIC_KEYS`): rates over all episodes, speedups over the correct
    ones (geometric mean, best), and per-episode means (turns, tool calls and errors, seconds)."""
    rows = [i for i in infos if isinstance(i, dict) and i]
    if not rows:
        return {}

    def col(key: str) -> np.ndarray:
        return np.array([float(r.get(key) or 0.0) for r in rows], dtype=np.float64)

    correct = col("correct") > 0
    out = {f"{prefix}count": float(len(rows)),
           f"{prefix}pass_rate": float(correct.mean()),
           f"{prefix}compiled_rate": float((col("compiled") > 0).mean()),
           f"{prefix}submitted_rate": float((col("submitted") > 0).mean()),
           f"{prefix}truncated_rate": float((col("truncated") > 0).mean()),
           f"{prefix}response_budget_hit_rate": float((col("response_budget_hit") > 0).mean())}
    for key in ("speedup_vs_eager", "speedup_vs_compile"):
        s = col(key)[correct]
        s = s[s > 0]
        faster = (col(key)[correct] > 1.0).sum()
        out[f"{prefix}faster_than_{key.removeprefix('speedup_vs_')}_rate"] = float(faster / len(rows))
        if len(s):
            out[f"{prefix}{key}/geomean"] = float(math.exp(np.log(s).mean()))
            out[f"{prefix}{key}/max"] = float(s.max())
    for key in ("turns", "tool_calls", "tool_errors", "parse_errors", "compile_s", "verify_s", "profile_s",
                "submit_s", "env_s", "generate_s", "response_tokens", "tool_tokens"):
        c = col(key)
        out[f"{prefix}{key}/mean"] = float(c.mean())
        out[f"{prefix}{key}/max"] = float(c.max())
    return out


@register_trainer(TRAINER_MODE)
class KernelTrainer(PPOTrainerSync):
    """verl's synchronous v1 trainer; each step's metrics also hold `episode_metrics`."""

    def _compute_metrics(self, batch: Any, metrics: dict[str, Any], timing_raw: dict[str, float], global_steps: int,
                         epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update(episode_metrics(batch_reward_extra_infos(batch)))


def batch_reward_extra_infos(batch: Any) -> list[dict[str, Any] | None]:
    """Each (non-padding) episode's ``reward_extra_info`` of a v1 batch (`KVBatchMeta`), read from
    the TransferQueue where verl's v1 agent-loop worker put it (in ``extra_fields``)."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    fields = data["extra_fields"]
    fields = fields.tolist() if hasattr(fields, "tolist") else list(fields)
    keep = [not tag.get("is_padding", False) for tag in batch.tags]
    return [(f or {}).get("reward_extra_info") if isinstance(f, dict) else None for f, k in zip(fields, keep) if k]


@contextlib.contextmanager
def shared_pool(config: DictConfig) -> Iterator[Any]:
    """The run's evaluation pool, started (named) for the length of the block where the config's
    evaluator is ``backend: ray``; None otherwise (a local evaluator per worker, CPU target)."""
    settings = RunSettings.of(OmegaConf.to_container(config.get("cudagym") or {}, resolve=True))
    spec = settings.evaluator
    if spec.backend != "ray":
        yield None
        return
    from cudagym.pool import EvalPool

    trainer = config.trainer
    check_cluster(settings, ray.cluster_resources(), int(trainer.n_gpus_per_node) * int(trainer.nnodes))
    pool = EvalPool.start(spec.pool_config(), name=spec.pool.name, namespace=spec.pool.namespace)
    try:
        yield pool
    finally:
        pool.close()


class _KernelTaskRunner(TaskRunnerV1.__ray_actor_class__):  # type: ignore[name-defined]
    def run(self, config: DictConfig) -> None:
        with shared_pool(config):
            super().run(config)


class _KernelTaskRunnerV0(TaskRunner.__ray_actor_class__):  # type: ignore[name-defined]
    def run(self, config: DictConfig) -> None:
        with shared_pool(config):
            super().run(config)


KernelTaskRunner = ray.remote(num_cpus=1)(_KernelTaskRunner)
KernelTaskRunnerV0 = ray.remote(num_cpus=1)(_KernelTaskRunnerV0)
