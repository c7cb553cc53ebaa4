"""The command line's options for the config models' settings are read from the models: one
default and one help text per setting, whichever command offers it."""

from __future__ import annotations

import typer.main

from cudagym.agent.runner import RunConfig
from cudagym.cli import app
from cudagym.options import choices, field_default
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.rewards.milestone import RewardConfig
from cudagym.sandbox.config import DockerSandboxConfig, SpareWorkerConfig


def _params(*path: str) -> dict[str, object]:
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.params}


def test_run_and_check_show_the_models_defaults_and_descriptions():
    run, check = _params("run"), _params("check")
    fields = {"target": EvaluatorConfig.model_fields["target"], "mode": EvaluatorConfig.model_fields["mode"],
              "sandbox": EvaluatorConfig.model_fields["sandbox"],
              "server_gaps": EvaluatorConfig.model_fields["server_gap_ms"],
              "reward_against": RewardConfig.model_fields["against"]}
    for name, field in fields.items():
        for params in (run, check):
            assert params[name].help == field.description, name
    assert run["sandbox"].default == check["sandbox"].default == "local" == field_default(EvaluatorConfig, "sandbox")
    assert run["target"].default == check["target"].default == EvaluatorConfig().target
    assert run["spare_workers"].help == SpareWorkerConfig.model_fields["spare_workers"].description
    assert run["spare_workers"].default is None
    assert run["episodes"].default == RunConfig().episodes and run["episodes"].help == \
        RunConfig.model_fields["episodes"].description
    assert check["compile_baseline"].default is EvaluatorConfig().compile_baseline is True
    assert _params("sandbox", "image", "build")["tag"].default == DockerSandboxConfig().image
    assert choices(EvaluatorConfig, "sandbox") == ("local", "docker")
    assert choices(EvaluatorConfig, "target") == ("auto", "cuda", "cpu")
