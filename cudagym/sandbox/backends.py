"""The sandbox backend a config names, started: the one place that knows every backend (the
configs in `cudagym.sandbox.config` import none of them)."""

from __future__ import annotations

from pathlib import Path

from cudagym.sandbox.base import Sandbox
from cudagym.sandbox.config import DockerSandboxConfig, LocalSandboxConfig


def open_sandbox(config: LocalSandboxConfig | DockerSandboxConfig, home: Path, read_only: list[Path]) -> Sandbox:
    """The sandbox of `config`; workers' HOME is `home`. `read_only` is mounted read-only in every
    container of the docker backend (the evaluator's cache); a local worker reads the host's files
    under its Landlock rules."""
    if isinstance(config, DockerSandboxConfig):
        from cudagym.sandbox.docker import DockerSandbox  # the docker SDK: only where it is used

        return DockerSandbox(config, home=home, read_only=read_only)
    from cudagym.sandbox.local import LocalSandbox

    return LocalSandbox(config, home=home)
