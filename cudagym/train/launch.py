"""Stage configs for verl: compose, validate with verl's own classes, launch.

A stage config is a Hydra config composed on top of verl's ``ppo_trainer`` (verl 0.9.1): the
packaged ``cudagym_grpo`` and ``cudagym_ppo`` (``cudagym/train/configs/``), or a YAML file of
the user's whose ``defaults`` name one of them. `resolve_config` composes it with overrides
(``key=value``, Hydra syntax) and points ``rollout.agent.agent_loop_config_path`` at the
packaged ``agent_loops.yaml`` unless the config names its own. `validate_config` runs verl's
``validate_config`` and builds verl's dataclasses for the rollout, actor, model and data
sections (``omega_conf_to_dataclass``), then cudagym's own checks: multi-turn async rollout,
the ``cudagym_kernel`` loop and its settings, and a context (prompt + response) within the
rollout's ``max_model_len`` and the env's token budget. `launch` hands the config to verl's
``run_ppo`` (Ray underneath), as ``python -m verl.trainer.main_ppo`` would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cudagym.errors import ConfigError

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
    settings = loop_settings(cfg)
    try:
        env = EnvConfig.model_validate({**settings.env, "target": settings.evaluator.target,
                                        "mode": settings.evaluator.mode})
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"agent loop env settings: {e}") from None
    if env.max_tokens is not None and env.max_tokens > context:
        notes.append(f"the env's token budget ({env.max_tokens}) exceeds prompt + response ({context}); "
                     "verl's response_length ends episodes first (the workspace is then scored as it stands)")
    if need_critic(cfg) and cfg.algorithm.adv_estimator == "grpo":
        raise ConfigError("GRPO needs no critic: set critic.enable=false or algorithm.adv_estimator=gae")
    return notes


def launch(cfg: DictConfig) -> None:
    """Run verl's PPO/GRPO trainer on `cfg` (validated first), as verl's ``main_ppo`` does."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(cfg)
    validate_config(cfg)
    if cfg.trainer.use_v1:
        run_ppo(cfg, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(cfg, task_runner_class=TaskRunner)
