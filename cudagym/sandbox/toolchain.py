"""Compiling a workspace's kernels (being implemented; the interface below is fixed)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from cudagym.rewards.verdict import CompileResult
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target


class ToolchainConfig(BaseModel):
    """Compilers, flags and limits of the compile tool."""

    cxx: str = "g++"
    nvcc: str = "nvcc"
    cuda_arch: str | None = None  # e.g. "sm_90a"; None: detected from the GPU
    timeout_s: float = 180.0
    max_jobs: int = 4
    extra_cflags: list[str] = []
    extra_cuda_cflags: list[str] = []
    max_error_lines: int = 40


class Toolchain:
    def __init__(self, cache_dir: Path, config: ToolchainConfig | None = None): ...

    def build(self, workspace: Workspace, target: Target) -> CompileResult:
        raise NotImplementedError

    async def abuild(self, workspace: Workspace, target: Target) -> CompileResult:
        raise NotImplementedError
