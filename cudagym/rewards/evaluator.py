"""The evaluator: compile → verify → profile → milestone reward (being implemented)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from cudagym.rewards.milestone import RewardConfig
from cudagym.rewards.verdict import AuditMode, CompileResult, ProfileResult, Verdict, VerifyResult
from cudagym.sandbox.toolchain import ToolchainConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target, Task


def default_cache_dir() -> Path:
    return Path(os.environ.get("CUDAGYM_CACHE", Path.home() / ".cache" / "cudagym"))


class EvaluatorConfig(BaseModel):
    target: Literal["auto", "cuda", "cpu"] = "auto"
    mode: AuditMode = "strict"
    cache_dir: Path = Field(default_factory=default_cache_dir)
    toolchain: ToolchainConfig = Field(default_factory=ToolchainConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)


class Evaluator:
    """compile / verify / profile / evaluate a workspace for a task; async forms `a*`."""

    def __init__(self, config: EvaluatorConfig | None = None): ...

    @property
    def target(self) -> Target: ...

    async def acompile(self, task: Task, workspace: Workspace) -> CompileResult: ...
    async def averify(self, task: Task, workspace: Workspace) -> VerifyResult: ...
    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult: ...
    async def aevaluate(self, task: Task, workspace: Workspace) -> Verdict: ...
    def compile(self, task: Task, workspace: Workspace) -> CompileResult: ...
    def verify(self, task: Task, workspace: Workspace) -> VerifyResult: ...
    def profile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult: ...
    def evaluate(self, task: Task, workspace: Workspace) -> Verdict: ...
    def close(self) -> None: ...
