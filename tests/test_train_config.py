"""`cudagym train --dry-run`'s own checks (no Ray, no GPU): evaluation GPUs apart from training
GPUs, the model's context against ``max_model_len`` (from a config.json written here), and steps
per epoch against the prepared data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

try:
    import verl  # noqa: F401
except ImportError:  # CI installs it (.ci/verl-nodeps.txt): there a missing verl is a failure
    if os.environ.get("CI"):
        raise
    pytest.skip("verl is not installed: pip install --no-deps -r .ci/verl-nodeps.txt", allow_module_level=True)

from typer.testing import CliRunner

from cudagym.cli import app
from cudagym.errors import ConfigError
from cudagym.train.launch import context_reach
from cudagym.train.settings import RunSettings, check_cluster, check_gpu_layout

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _model(tmp: Path, name: str, **config) -> Path:
    """A model directory with only a config.json (what the check reads)."""
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                               "rope_theta": 1000000, **config}))
    return d


def _dry(*args: str):
    return CliRunner().invoke(app, ["train", "grpo", *args, "--dry-run"])


@pytest.fixture(scope="module")
def reaching(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory.mktemp("models"), "long", max_position_embeddings=262144)


def test_packaged_layout_keeps_evaluation_off_training_gpus(reaching: Path) -> None:
    result = _dry(f"actor_rollout_ref.model.path={reaching}")
    assert result.exit_code == 0, result.output
    assert "training on 6 GPU(s) x 1 node(s); evaluation pool 'cudagym-eval' on 2 other GPU(s)" in " ".join(
        result.output.split())


@pytest.mark.parametrize("overrides, words", [
    (["trainer.n_gpus_per_node=7"], "evaluation GPUs overlap the training GPUs"),
    (["trainer.n_gpus_per_node=8"], "evaluation GPUs overlap the training GPUs"),
    (["cudagym.evaluator.pool.gpus=3"], "evaluation GPUs overlap the training GPUs"),
    (["cudagym.evaluator.backend=local"], "backend 'local'"),
    (["trainer.n_gpus_per_node=8", "trainer.nnodes=2", "cudagym.eval_nodes=1"], "several nodes need"),
])
def test_dry_run_refuses_overlapping_training_and_evaluation_gpus(reaching: Path, overrides, words) -> None:
    result = _dry(f"actor_rollout_ref.model.path={reaching}", *overrides)
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split())


def test_gpu_layouts() -> None:
    one = RunSettings.of({"evaluator": {"backend": "ray", "pool": {"gpus": 2, "gpu_resource": None}}})
    assert "2 per training node" in check_gpu_layout(one, 6, 1)
    with pytest.raises(ConfigError, match="overlap"):
        check_gpu_layout(one, 7, 1)
    # many nodes: 4 training nodes of 8, one evaluation node of 8, a resource keeps them apart
    many = RunSettings.of({"eval_nodes": 1, "evaluator": {"backend": "ray", "pool": {"gpus": 8}}})
    assert "8 on each of 1 evaluation node(s)" in check_gpu_layout(many, 8, 4)
    with pytest.raises(ConfigError, match="overlap"):
        check_gpu_layout(many.model_copy(update={"eval_nodes": 0}), 8, 4)
    # the CPU target takes no GPU; a local evaluator is for it only
    cpu = RunSettings.of({"evaluator": {"backend": "local", "target": "cpu"}})
    assert check_gpu_layout(cpu, 8, 1).startswith("evaluation on the CPU target")
    with pytest.raises(ConfigError, match="backend 'local'"):
        check_gpu_layout(RunSettings.of({"evaluator": {"backend": "local", "target": "cuda"}}), 6, 1)
    # at launch, on the live cluster
    check_cluster(many, {"GPU": 40, "cudagym_eval": 8}, 32)
    with pytest.raises(ConfigError, match="overlap"):
        check_cluster(many, {"GPU": 32, "cudagym_eval": 8}, 32)
    with pytest.raises(ConfigError, match="ray start"):
        check_cluster(many, {"GPU": 40}, 32)


def test_dry_run_reads_the_models_context(tmp_path: Path) -> None:
    short = _model(tmp_path, "qwen3-8b", max_position_embeddings=40960)
    result = _dry(f"actor_rollout_ref.model.path={short}")
    assert result.exit_code == 2 and "reaches 40960 tokens" in " ".join(result.output.split()), result.output
    yarn = _model(tmp_path, "qwen3-8b-yarn", max_position_embeddings=40960, rope_scaling=YARN)
    result = _dry(f"actor_rollout_ref.model.path={yarn}")
    assert result.exit_code == 0 and "reaches 131072 tokens" in " ".join(result.output.split()), result.output
    result = _dry(f"actor_rollout_ref.model.path={yarn}", "actor_rollout_ref.rollout.max_model_len=200000",
                  "data.max_response_length=180000")
    assert result.exit_code == 2 and "reaches 131072 tokens" in " ".join(result.output.split()), result.output
    # rope scaling only for vLLM: the trainer would see 40960
    result = _dry(f"actor_rollout_ref.model.path={short}",
                  "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.rope_scaling.rope_type=yarn",
                  "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.rope_scaling.factor=4.0",
                  "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.rope_scaling."
                  "original_max_position_embeddings=32768")
    assert result.exit_code == 2 and "for the actor" in " ".join(result.output.split()), result.output
    # verl's override_config cannot set a dict attribute: refused before any worker starts
    result = _dry(f"actor_rollout_ref.model.path={short}",
                  "+actor_rollout_ref.model.override_config.rope_scaling.rope_type=yarn")
    assert result.exit_code == 2 and "override_config" in result.output, result.output
    # no config to read (offline, not cached): said, and the rest is still checked
    result = _dry(f"actor_rollout_ref.model.path={tmp_path / 'absent'}")
    assert result.exit_code == 0 and "cannot read the config of model" in " ".join(result.output.split())
    result = _dry("actor_rollout_ref.model.path=no-such-org/no-such-model")
    assert result.exit_code == 0 and "not in the Hugging Face cache" in " ".join(result.output.split())


def test_verl_cannot_apply_rope_scaling_through_override_config() -> None:
    """Why the dry run refuses it: verl's own update_model_config on a transformers config."""
    from transformers import Qwen3Config
    from verl.utils.model import update_model_config

    with pytest.raises(AttributeError):
        update_model_config(Qwen3Config(max_position_embeddings=40960), {"rope_scaling": dict(YARN)})


def test_context_reach() -> None:
    assert context_reach({"max_position_embeddings": 40960}) == 40960
    assert context_reach({"max_position_embeddings": 40960, "rope_scaling": YARN}) == 131072
    assert context_reach({"max_position_embeddings": 40960}, {"rope_scaling": YARN}) == 131072
    # transformers 5 writes rope_parameters; llama3 states the stretched length itself
    assert context_reach({"max_position_embeddings": 32768, "rope_parameters": {**YARN, "rope_theta": 1e6}}) == 131072
    assert context_reach({"max_position_embeddings": 131072,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131072
    assert context_reach({"text_config": {"max_position_embeddings": 262144}}) == 262144


def test_prepare_bundled_fits_the_stage_configs(reaching: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    assert CliRunner().invoke(app, ["train", "prepare", "bundled", "--out", str(out)]).exit_code == 0
    rows = json.loads((out / "prepare.json").read_text())["train"]
    data = [f"data.train_files={out / 'train.parquet'}", f"data.val_files={out / 'val.parquet'}"]
    result = _dry(f"actor_rollout_ref.model.path={reaching}", *data)
    assert result.exit_code == 0, result.output
    assert f"{rows} training rows / data.train_batch_size 12 = 1 step(s) per epoch" in " ".join(result.output.split())
    result = _dry(f"actor_rollout_ref.model.path={reaching}", *data, "data.train_batch_size=16",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=16")
    assert result.exit_code == 2 and "0 steps per epoch" in " ".join(result.output.split()), result.output


def test_prepare_without_out_writes_where_the_config_reads(reaching: Path, tmp_path: Path, monkeypatch) -> None:
    """The acceptance's two commands as written: `cudagym train prepare bundled`, then the dry run
    of the bundled config, which finds the rows there and counts its steps from them."""
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["train", "prepare", "bundled"]).exit_code == 0
    assert (tmp_path / "data" / "cudagym" / "train.parquet").is_file()
    result = _dry(f"actor_rollout_ref.model.path={reaching}")
    assert result.exit_code == 0, result.output
    assert "step(s) per epoch" in " ".join(result.output.split()) and "not there yet" not in result.output
