"""`EvaluatorAPI`: what the environment, the runner and a trainer need of an evaluator.

Two implementations: `cudagym.rewards.evaluator.Evaluator` (one process, this host's GPUs) and
`cudagym.pool.EvalPool` (a client of evaluator actors on a Ray cluster). Whoever takes an
`Evaluator` (`KernelEnv(evaluator=...)`, `cudagym.agent.runner.arun(..., evaluator=...)`) takes
either. The async forms are safe to run concurrently; the sync forms call them (and refuse to
run inside an event loop). Failures of the candidate come back inside the results, never raised.
`profiled` (an episode's `ProfileMemo`) lets a submit reuse the timing of a profile of the same
evidence (`cudagym.rewards.reuse`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cudagym.core.verdict import CompileResult, ProfileResult, Verdict, VerifyResult
from cudagym.rewards.reuse import ProfileMemo
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target, Task


@runtime_checkable
class EvaluatorAPI(Protocol):
    @property
    def target(self) -> Target: ...

    async def acompile(self, task: Task, workspace: Workspace) -> CompileResult: ...

    async def averify(self, task: Task, workspace: Workspace) -> VerifyResult: ...

    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult: ...

    async def aevaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Verdict: ...

    def compile(self, task: Task, workspace: Workspace) -> CompileResult: ...

    def verify(self, task: Task, workspace: Workspace) -> VerifyResult: ...

    def profile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult: ...

    def evaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Verdict: ...

    def close(self) -> None: ...
