"""Stage configs for verl: compose, validate with verl's own classes, launch.

A stage config is a Hydra config composed on top of verl's ``ppo_trainer`` (verl 0.9.1): the
packaged ``cudagym_grpo`` and ``cudagym_ppo`` (``cudagym/train/configs/``), or a YAML file of
the user's whose ``defaults`` name one of them. `resolve_config` composes it with overrides
(``key=value``, Hydra syntax) and points ``rollout.agent.agent_loop_config_path`` at the
packaged ``agent_loops.yaml`` unless the config names its own. `validate_config` runs verl's
``validate_config`` and builds verl's dataclasses for the rollout, actor, model and data
sections (``omega_conf_to_dataclass``), then cudagym's own checks: multi-turn async rollout,
the ``cudagym_kernel`` loop and its settings, a context (prompt + response) within the
rollout's ``max_model_len`` and the env's token budget, evaluation GPUs apart from the trainer's
(`cudagym.train.settings.check_gpu_layout`), a ``max_model_len`` the named model reaches (its
config.json, local or in the Hugging Face cache, never downloaded: `check_model_context`), and at
least one step per epoch of the prepared data (`check_train_data`). `launch` hands the config to
verl's ``run_ppo`` (Ray underneath), as ``python -m verl.trainer.main_ppo`` would, with cudagym's
task runner (`cudagym.train.runner`: the run's evaluation pool, the episodes in the step metrics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cudagym.errors import ConfigError
from cudagym.train.settings import TRAINER_MODE, RunSettings, check_gpu_layout

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
AGENT_LOOPS = CONFIG_DIR / "agent_loops.yaml"
STAGES = {"grpo": "cudagym_grpo", "ppo": "cudagym_ppo"}
MAX_CONTEXT = 131072


def stage_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("cudagym_*.yaml"))


def resolve_config(config: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose stage `config` (``grpo``, ``ppo``, a packaged name, or a YAML path) with `overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    name = STAGES.get(config, config)
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"{config}: no such config file")
        config_dir, name = path.resolve().parent, path.stem
    elif name in stage_names():
        config_dir = CONFIG_DIR
    else:
        raise ConfigError(f"unknown stage config {config!r}: use grpo, ppo, {', '.join(stage_names())} "
                          "or a path to a .yaml file")
    search = f"hydra.searchpath=[pkg://verl.trainer.config,file://{CONFIG_DIR}]"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = compose(config_name=name, overrides=[search, *(overrides or [])])
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"config {config!r}: {e}") from None
    finally:
        GlobalHydra.instance().clear()
    agent = cfg.actor_rollout_ref.rollout.agent
    if not agent.agent_loop_config_path:
        agent.agent_loop_config_path = str(AGENT_LOOPS)
    return cfg


def loop_settings(cfg: DictConfig) -> Any:
    """The ``cudagym_kernel`` entry of the config's agent-loop file, validated (`LoopSettings`)."""
    from cudagym.train import AGENT_NAME
    from cudagym.train.verl_loop import LoopSettings

    path = Path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    if not path.is_file():
        raise ConfigError(f"agent_loop_config_path {path}: no such file")
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entry = next((e for e in entries or [] if isinstance(e, dict) and e.get("name") == AGENT_NAME), None)
    if entry is None:
        raise ConfigError(f"{path} has no entry named {AGENT_NAME!r}")
    fields = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
    try:
        return LoopSettings.model_validate(fields)
    except Exception as e:  # noqa: BLE001 - pydantic's message names the field
        raise ConfigError(f"{path}: {e}") from None


def validate_config(cfg: DictConfig) -> list[str]:
    """Validate `cfg` with verl's classes and cudagym's checks; returns notes, raises `ConfigError`."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.config import validate_config as verl_validate

    from cudagym.env.kernel_env import EnvConfig
    from cudagym.train import AGENT_NAME

    from hydra.errors import InstantiationException

    notes: list[str] = []
    try:
        OmegaConf.resolve(cfg)
        verl_validate(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        omega_conf_to_dataclass(cfg.algorithm)
    except (AssertionError, ValueError, TypeError, AttributeError, InstantiationException) as e:
        raise ConfigError(f"verl rejected the config: {e}") from None
    if rollout.mode != "async":
        raise ConfigError("actor_rollout_ref.rollout.mode must be 'async': agent loops run on verl's async server")
    if not rollout.multi_turn.enable:
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable must be true for KernelEnv episodes")
    if rollout.agent.default_agent_loop != AGENT_NAME:
        notes.append(f"default_agent_loop is {rollout.agent.default_agent_loop!r}; rows without agent_name use it")
    context = int(rollout.prompt_length) + int(rollout.response_length)
    if rollout.max_model_len is not None and context > int(rollout.max_model_len):
        raise ConfigError(f"prompt_length + response_length = {context} exceeds rollout.max_model_len "
                          f"= {rollout.max_model_len}")
    if context > MAX_CONTEXT:
        notes.append(f"context {context} tokens is above the 128K ({MAX_CONTEXT}) the stage configs are sized for")
    run = RunSettings.of(OmegaConf.to_container(cfg.get("cudagym") or {}, resolve=True))
    notes.append(check_gpu_layout(run, int(cfg.trainer.n_gpus_per_node), int(cfg.trainer.nnodes)))
    notes += check_model_context(cfg, context)
    notes += check_train_data(cfg)
    notes += _trainer_notes(cfg)
    settings = loop_settings(cfg)
    try:
        env = EnvConfig.model_validate({**settings.env, "target": run.evaluator.target, "mode": run.evaluator.mode})
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"agent loop env settings: {e}") from None
    if env.max_tokens is not None and env.max_tokens > context:
        notes.append(f"the env's token budget ({env.max_tokens}) exceeds prompt + response ({context}); "
                     "verl's response_length ends episodes first (the workspace is then scored as it stands)")
    if need_critic(cfg) and cfg.algorithm.adv_estimator == "grpo":
        raise ConfigError("GRPO needs no critic: set critic.enable=false or algorithm.adv_estimator=gae")
    return notes


def _trainer_notes(cfg: DictConfig) -> list[str]:
    if not cfg.trainer.use_v1:
        return ["trainer.use_v1 is false: verl's v0 trainer logs the episodes' outcomes with validation only"]
    if cfg.trainer.v1.trainer_mode != TRAINER_MODE:
        return [f"trainer.v1.trainer_mode is {cfg.trainer.v1.trainer_mode!r}: the episodes' outcomes reach the "
                f"training step's metrics only with {TRAINER_MODE!r}"]
    return []


def check_train_data(cfg: DictConfig) -> list[str]:
    """Refuse training data that gives no step (fewer rows than ``data.train_batch_size``: verl's
    sampler drops the last partial batch); a note where the file is not there (yet)."""
    import pyarrow.parquet as pq

    files = cfg.data.train_files
    files = [files] if isinstance(files, str) else list(files)
    rows = 0
    for f in files:
        path = Path(str(f)).expanduser()
        if not path.is_file():
            return [f"data.train_files {f}: not there yet (write it with `cudagym train prepare SRC --out DIR`); "
                    "steps per epoch not checked"]
        rows += pq.ParquetFile(path).metadata.num_rows
    batch = int(cfg.data.train_batch_size)
    steps = rows // batch
    if steps == 0:
        raise ConfigError(f"{rows} training rows and data.train_batch_size = {batch}: 0 steps per epoch (verl drops "
                          f"the last partial batch); set data.train_batch_size={rows} or less (with "
                          "actor_rollout_ref.actor.ppo_mini_batch_size at most that), or prepare more tasks")
    epochs = int(cfg.trainer.total_epochs)
    return [f"{rows} training rows / data.train_batch_size {batch} = {steps} step(s) per epoch, "
            f"{steps * epochs} in {epochs} epoch(s)" + (f" ({rows - steps * batch} row(s) left out each epoch)"
                                                         if rows % batch else "")]


class ModelConfigUnreadableError(ConfigError):
    """A model's config.json is neither in a local directory nor in the Hugging Face cache."""


def read_model_config(path: str) -> dict[str, Any]:
    """The model's ``config.json``: from the directory `path`, else from the Hugging Face cache
    (never downloaded: a dry run stays offline)."""
    import json

    local = Path(path).expanduser()
    candidates = [local / "config.json"] if local.is_dir() else []
    if not candidates and "://" not in path and not local.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(repo_id=path, filename="config.json")
        except Exception:  # noqa: BLE001 - not a repo id: unreadable, said below
            hit = None
        if isinstance(hit, str):
            candidates.append(Path(hit))
    for c in candidates:
        if c.is_file():
            try:
                return json.loads(c.read_text())
            except (OSError, ValueError) as e:
                raise ModelConfigUnreadableError(f"cannot read the config of model {path}: {c}: {e}") from None
    where = f"{local} has no config.json" if local.is_dir() else "it is not a local directory"
    raise ModelConfigUnreadableError(
        f"cannot read the config of model {path} ({where}, and it is not in the Hugging Face cache; this check does "
        f"not download): fetch it first (`hf download {path} config.json`) or point actor_rollout_ref.model.path at "
        "a local copy")


# rope types whose factor stretches the original context (vLLM's rule); llama3 and longrope
# configs already state the stretched length as max_position_embeddings
_SCALED_ROPE = ("yarn", "dynamic", "linear")


def context_reach(model: dict[str, Any], overrides: dict[str, Any] | None = None) -> int:
    """The longest sequence (tokens) a model config reaches: ``max_position_embeddings``, or the
    original length times the rope scaling factor (YaRN, dynamic, linear) as vLLM derives it;
    `overrides` are applied on top, as verl's ``override_config`` / vLLM's ``hf_overrides``."""
    merged = {**model, **(overrides or {})}
    text = {**(model.get("text_config") or {}), **((overrides or {}).get("text_config") or {})}
    if text:
        merged = {**merged, **text}
    base = int(merged.get("max_position_embeddings") or merged.get("max_sequence_length")
               or merged.get("seq_length") or 0)
    rope = merged.get("rope_scaling") or merged.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind in _SCALED_ROPE and rope.get("factor"):
        original = int(rope.get("original_max_position_embeddings") or base)
        return int(original * float(rope["factor"]))
    return base


def _plain(value: Any) -> dict[str, Any]:
    """A config mapping as a plain dict ({} for None)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return dict(value or {})


def check_model_context(cfg: DictConfig, context: int) -> list[str]:
    """Refuse a ``rollout.max_model_len`` (and prompt + response) above what the named model
    reaches, with the rope scaling the config gives vLLM (``rollout.engine_kwargs.vllm.hf_overrides``)
    and the trainer (``model.override_config``); a note where the model's config cannot be read."""
    rollout = cfg.actor_rollout_ref.rollout
    wanted = int(rollout.max_model_len) if rollout.max_model_len is not None else context
    path = str(cfg.actor_rollout_ref.model.path)
    vllm = _plain(OmegaConf.select(cfg, "actor_rollout_ref.rollout.engine_kwargs.vllm"))
    sides = {"rollout (vLLM, engine_kwargs.vllm.hf_overrides)": (wanted, _plain(vllm.get("hf_overrides"))),
             "actor (model.override_config)":
                 (context, _plain(OmegaConf.select(cfg, "actor_rollout_ref.model.override_config")))}
    if cfg.critic.get("enable"):
        sides["critic (critic.model.override_config)"] = (
            context, _plain(OmegaConf.select(cfg, "critic.model.override_config")))
    for side, (_, overrides) in sides.items():
        nested = [k for k in ("rope_scaling", "rope_parameters") if isinstance(overrides.get(k), dict)]
        if nested and "override_config" in side:
            # verl's update_model_config recurses into a dict value and setattr()s its keys on the
            # config's current value (a dict, or None): an AttributeError when the workers start
            raise ConfigError(f"{side}: verl cannot apply {nested[0]} through override_config; give the model its rope "
                              "scaling in config.json (a local copy), which vLLM and the trainer both read")
    try:
        model = read_model_config(path)
    except ModelConfigUnreadableError as e:
        return [f"{e}; the {wanted}-token context is not checked against the model"]
    reached = []
    for side, (need, overrides) in sides.items():
        reach = context_reach(model, overrides)
        if need > reach:
            raise ConfigError(
                f"model {path} reaches {reach} tokens for the {side}, the config asks {need}: lower "
                "actor_rollout_ref.rollout.max_model_len (and data.max_prompt_length + max_response_length), name a "
                "model whose context reaches it, or give it rope scaling (YaRN) in its config.json (read by vLLM and "
                "the trainer alike)")
        reached.append(reach)
    return [f"model {path} reaches {min(reached)} tokens (needs {wanted})"]


def launch(cfg: DictConfig) -> None:
    """Run verl's PPO/GRPO trainer on `cfg` (validated first), as verl's ``main_ppo`` does, with
    cudagym's task runner (the run's evaluation pool; the episodes' outcomes in each step's metrics)."""
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    from cudagym.train.runner import KernelTaskRunner, KernelTaskRunnerV0

    auto_set_device(cfg)
    validate_config(cfg)
    run_ppo(cfg, task_runner_class=KernelTaskRunner if cfg.trainer.use_v1 else KernelTaskRunnerV0)
