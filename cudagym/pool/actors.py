"""`EvaluatorActor`: one `Evaluator` living in one Ray actor process.

The pool makes two kinds of them from this one class, differing only in their Ray resources and
in what the client sends them:

- a **device actor** per GPU (``num_gpus=1``; Ray sets its ``CUDA_VISIBLE_DEVICES``): it owns
  the evaluator of that GPU with its spare workers, its GPU lease (timing jobs have the GPU to
  themselves, checks share it), and the node's build and baseline caches. It runs verify,
  profile, and the compiles that need the device (``load_inline`` solutions on the CUDA
  target run model_new.py on the GPU to learn what to build).
- a **compile actor** (CPU resources only): it runs the host compilers for ``kernels/`` (and,
  on the CPU target, everything of a compile) so that compiles do not queue behind GPU work.

An actor is asynchronous (``max_concurrency`` jobs at once): its evaluator already queues work
on its device, so the actor does not serialize calls itself. Each call gets the workspace as a
`WorkspaceSnapshot`, materialized under the node's cache directory for that call only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cudagym.pool.snapshot import WorkspaceSnapshot
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.rewards.reuse import ProfileMemo
from cudagym.core.verdict import CompileResult, ProfileResult, VerifyResult
from cudagym.sandbox.schedule import LeaseHold
from cudagym.tasks.model import Target, Task


class EvaluatorActor:
    def __init__(self, config: EvaluatorConfig) -> None:
        self.evaluator = Evaluator(config)
        self.scratch = Path(config.cache_dir) / "pool-workspaces"

    def info(self) -> dict[str, Any]:
        """Where this actor runs and what it evaluates on (also a liveness ping)."""
        import ray

        ev = self.evaluator
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "target": ev.target.value,
                "device_name": ev.device_name,
                "cuda_arch": ev.toolchain.cuda_arch if ev.target == Target.CUDA else None}

    async def compile(self, task: Task, snapshot: WorkspaceSnapshot) -> CompileResult:
        with snapshot.materialized(self.scratch, task) as ws:
            return await self.evaluator.acompile(task, ws)

    async def verify(self, task: Task, snapshot: WorkspaceSnapshot) -> VerifyResult:
        with snapshot.materialized(self.scratch, task) as ws:
            return await self.evaluator.averify(task, ws)

    async def profile(self, task: Task, snapshot: WorkspaceSnapshot, ncu: bool = False) -> ProfileResult:
        with snapshot.materialized(self.scratch, task) as ws:
            return await self.evaluator.aprofile(task, ws, ncu)

    async def judge(self, task: Task, snapshot: WorkspaceSnapshot,
                    profiled: ProfileMemo | None = None) -> tuple[VerifyResult, ProfileResult | None]:
        """verify, then the timing if correct (the episode's profile of the same evidence, else a
        profile job): the device half of `submit`, in one call (`Evaluator.ajudge`)."""
        with snapshot.materialized(self.scratch, task) as ws:
            return await self.evaluator.ajudge(task, ws, profiled)

    def lease_holds(self) -> list[LeaseHold]:
        """The GPU leases its evaluator's sandbox held (`JobScheduler.holds`; `time.perf_counter`
        of this actor's process, CLOCK_MONOTONIC, comparable with other processes of its node)."""
        return list(getattr(self.evaluator.sandbox, "lease_holds", []))

    def __del__(self) -> None:
        ev = getattr(self, "evaluator", None)
        if ev is not None:
            ev.close()
