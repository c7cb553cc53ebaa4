"""cudagym's own section of a stage config (``cudagym:``): where episodes are evaluated, and the
cluster's GPU layout that keeps evaluation off the trainer's GPUs.

Why evaluation has GPUs of its own: vLLM generates and the trainer trains on every GPU verl holds,
so a kernel timed there is timed beside generation, and "a GPU never times two things at once"
(the evaluator's lease) no longer holds. The run therefore has **one** evaluation pool
(`cudagym.pool.EvalPool`), started once by ``cudagym train`` (its task runner) before verl's
workers, on GPUs verl does not use, with its own leases; every agent-loop worker connects to it
by name and none starts its own. Ray keeps the two apart: verl's placement groups take
``trainer.n_gpus_per_node`` GPUs of each of ``trainer.nnodes`` nodes, and each device actor of the
pool asks for one GPU *and* one unit of a custom resource (``cudagym_eval``) that only the
evaluation GPUs' nodes offer (``ray start --resources='{"cudagym_eval": 2}'``), as many units per
node as that node has GPUs for evaluation.

Nothing here imports verl: ``cudagym train --dry-run`` checks the layout with these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cudagym.errors import ConfigError

TRAINER_MODE = "cudagym_sync"  # verl v1 trainer mode of `cudagym.train.runner.KernelTrainer`


class PoolSpec(BaseModel):
    """The run's evaluation pool (backend ``ray``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "cudagym-eval"  # its actors are NAME:device-0, ..., NAME:compile-0, ...
    namespace: str = "cudagym"  # the Ray namespace of those names (any job of the cluster reaches it)
    gpus: int = Field(default=2, ge=1)  # device actors: one evaluation GPU each (CPU target: CPU slots)
    # the Ray custom resource each device actor asks one unit of; None: any free GPU (one node only)
    gpu_resource: str | None = "cudagym_eval"
    compile_actors: int = Field(default=2, ge=0)  # host compilers (CPU only)


class EvaluatorSpec(BaseModel):
    """Where the episodes of a run are evaluated."""

    model_config = ConfigDict(extra="forbid")

    # ray: the run's one named pool on evaluation GPUs; local: an Evaluator in each agent-loop
    # worker's process, which sees the trainer's GPUs (the CPU target only: tests, CPU kernels)
    backend: Literal["local", "ray"] = "local"
    target: Literal["auto", "cuda", "cpu"] = "auto"
    mode: Literal["strict", "permissive"] = "strict"
    compile_baseline: bool = True  # the +3 milestone needs torch.compile timings
    pool: PoolSpec = Field(default_factory=PoolSpec)

    def key(self) -> str:
        """Identity of the evaluator this spec gives (a local one does not depend on the pool's settings)."""
        return self.model_dump_json(exclude={"pool"} if self.backend == "local" else None)

    def evaluator_config(self) -> Any:
        """The `EvaluatorConfig` of each evaluator (the local one, or each actor's of the pool)."""
        from cudagym.rewards.evaluator import EvaluatorConfig

        return EvaluatorConfig(target=self.target, mode=self.mode, compile_baseline=self.compile_baseline)

    def pool_config(self) -> Any:
        """The `PoolConfig` the run's pool is started with (and its clients use)."""
        from cudagym.pool import PoolConfig

        resources = {self.pool.gpu_resource: 1.0} if self.pool.gpu_resource else {}
        return PoolConfig(evaluator=self.evaluator_config(), device_actors=self.pool.gpus,
                          compile_actors=self.pool.compile_actors, device_resources=resources)


class RunSettings(BaseModel):
    """The ``cudagym:`` section of a stage config."""

    model_config = ConfigDict(extra="forbid")

    evaluator: EvaluatorSpec = Field(default_factory=EvaluatorSpec)
    gpus_per_node: int = Field(default=8, ge=0)  # GPUs of each node of the cluster (all alike)
    eval_nodes: int = Field(default=0, ge=0)  # nodes for evaluation only, beside trainer.nnodes

    @classmethod
    def of(cls, section: Any) -> RunSettings:
        """Validated from a config's ``cudagym`` section (a mapping; None: the defaults)."""
        try:
            return cls.model_validate(section or {})
        except Exception as e:  # noqa: BLE001 - pydantic's message names the field
            raise ConfigError(f"the cudagym section of the config: {e}") from None


def check_gpu_layout(settings: RunSettings, train_gpus_per_node: int, train_nodes: int) -> str:
    """Refuse a layout where evaluation would share the trainer's GPUs; returns it in words.

    The trainer (verl: actor, rollout, reference, critic, colocated) takes `train_gpus_per_node`
    GPUs of each of `train_nodes` nodes; evaluation gets what is left of those nodes plus every
    GPU of ``eval_nodes`` evaluation-only nodes, and must fit there."""
    ev = settings.evaluator
    if ev.target == "cpu":
        return "evaluation on the CPU target (no GPU)"
    if ev.backend == "local":
        raise ConfigError(
            "cudagym.evaluator.backend 'local' puts an Evaluator in every agent-loop worker, where it sees (and times "
            "kernels on) the GPUs vLLM and the trainer use: set cudagym.evaluator.backend=ray (one pool on evaluation "
            "GPUs), or target=cpu")
    per_node = settings.gpus_per_node
    if train_gpus_per_node > per_node:
        raise ConfigError(f"trainer.n_gpus_per_node = {train_gpus_per_node} is more than the "
                          f"{per_node} GPUs of a node (cudagym.gpus_per_node)")
    spare = per_node - train_gpus_per_node
    room = train_nodes * spare + settings.eval_nodes * per_node
    if ev.pool.gpus > room:
        raise ConfigError(
            f"evaluation GPUs overlap the training GPUs: cudagym.evaluator.pool.gpus = {ev.pool.gpus}, but the trainer "
            f"takes {train_gpus_per_node} of the {per_node} GPUs of each of its {train_nodes} node(s), which leaves "
            f"{room} (with {settings.eval_nodes} evaluation-only node(s)); lower trainer.n_gpus_per_node, or add "
            "evaluation nodes (cudagym.eval_nodes)")
    if ev.pool.gpu_resource is None and train_nodes + settings.eval_nodes > 1:
        raise ConfigError("several nodes need cudagym.evaluator.pool.gpu_resource (a Ray custom resource each node "
                          "offers once per evaluation GPU): without it Ray may place evaluation actors on GPUs "
                          "that verl's placement groups need")
    where = []
    if spare and train_nodes:
        where.append(f"{spare} per training node")
    if settings.eval_nodes:
        where.append(f"{per_node} on each of {settings.eval_nodes} evaluation node(s)")
    return (f"training on {train_gpus_per_node} GPU(s) x {train_nodes} node(s); evaluation pool "
            f"{ev.pool.name!r} on {ev.pool.gpus} other GPU(s) ({', '.join(where)} available)")


def check_cluster(settings: RunSettings, resources: dict[str, float], train_gpus: int) -> None:
    """At launch, on the live cluster (``ray.cluster_resources()``): enough GPUs for training and
    evaluation together, and the evaluation resource offered for every evaluation GPU."""
    ev = settings.evaluator
    if ev.backend != "ray":
        return
    gpus = resources.get("GPU", 0)
    if ev.target != "cpu" and gpus < train_gpus + ev.pool.gpus:
        raise ConfigError(f"the Ray cluster has {gpus:g} GPUs; training takes {train_gpus} and evaluation "
                          f"{ev.pool.gpus}: they would overlap")
    res = ev.pool.gpu_resource
    if res is not None and resources.get(res, 0) < ev.pool.gpus:
        raise ConfigError(f"the Ray cluster offers {resources.get(res, 0):g} of resource {res!r}, the evaluation pool "
                          f"needs {ev.pool.gpus}: start each evaluation node with "
                          f"`ray start ... --resources='{{\"{res}\": N}}'` (N = its GPUs for evaluation)")
