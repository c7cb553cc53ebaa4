"""The episode runner: many episodes concurrently, every step stored, resumable, then a report.

Episodes are ``<task_id>@<k>`` for k in 0..episodes-1. Rerunning with the same ``out`` directory
resumes: complete episodes are skipped, interrupted ones (``.partial`` files) start over.
All episodes share one evaluator, which leases the GPU (or CPU) work itself: an `Evaluator` in
this process, or (``backend="ray"``) a client of an evaluation pool on a Ray cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from cudagym.agent.context import ContextBudget
from cudagym.agent.episode import EpisodeResult, run_episode
from cudagym.agent.policy import CallablePolicy, Policy
from cudagym.agent.report import GroupStats, write_report
from cudagym.agent.store import TrajectoryStore
from cudagym.env.kernel_env import EnvConfig, KernelEnv
from cudagym.env.variants import ContrastiveConfig, VariantBook
from cudagym.env.tokens import CharEstimate, TokenCounter, TokenizerCounter
from cudagym.errors import ConfigError
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.sandbox.config import reject_moved
from cudagym.tasks.model import Task, Tolerance

# settings that define which episodes a run directory holds; a resume must not change them
_IDENTITY = ("tasks", "policy", "episodes", "limit", "evaluator.target", "evaluator.mode", "tolerance", "max_turns")
# the run's settings that are its evaluator's (`RunConfig.evaluator`)
_MOVED = {k: f"evaluator.{k}" for k in ("target", "mode", "sandbox", "server_gap_ms")} | {
    "spare_workers": "evaluator.sandbox.spare_workers", "reward_against": "evaluator.reward.against"}


class RunConfig(BaseModel):
    """A `cudagym run`: its episodes, policy and evaluator. The command's options are these
    fields (`cudagym.options`): their help text is each field's description."""

    tasks: str = Field(default="bundled", description=(
        "Task source: 'bundled', a bundled task id, a task .py file, a KernelBench-style directory or an Ops-6K "
        ".parquet."))
    policy: str = Field(default="scripted", description=(
        "'scripted' (replays examples/solutions), 'openai' (an OpenAI-compatible server: OPENAI_BASE_URL, "
        "OPENAI_API_KEY, CUDAGYM_MODEL) or 'module:function' (a Python callable)."))
    episodes: int = Field(default=1, ge=1, description="Episodes per task.")
    limit: int | None = Field(default=None, ge=1, description="Run only the first N tasks of the source.")
    concurrency: int = Field(default=4, ge=1, description=(
        "Episodes running at once (the evaluator queues device work itself)."))
    # the run's evaluator (target, audit mode, sandbox backend and its spare workers, server-mode
    # timing, the milestones' baselines); with backend "ray", each pool actor's
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig)
    tolerance: Tolerance | None = None  # None: each task's own; else this, for every task
    out: Path | None = Field(default=None, description=(
        "Run directory for trajectories and the report (default runs/<timestamp>). Rerun with the same directory "
        "to resume."))
    max_turns: int = Field(default=30, ge=1, description=(
        "Turn budget per episode; at the limit the workspace is scored as it stands."))
    max_context_tokens: int | None = Field(default=None, description=(
        "Keep each policy prompt under this many tokens (older tool outputs are elided first)."))
    tokenizer: Path | None = Field(default=None, description=(
        "A tokenizer.json (Hugging Face tokenizers) for exact token counts; default: 4 chars per token."))
    solutions: Path | None = Field(default=None, description=(
        "Solutions root of the scripted policy (default: examples/solutions of the repository)."))
    model: str | None = Field(default=None, description="Model name for --policy openai (default: $CUDAGYM_MODEL).")
    base_url: str | None = Field(default=None, description=(
        "Server URL for --policy openai (default: $OPENAI_BASE_URL)."))
    tool_mode: Literal["native", "hermes"] = Field(default="native", description=(
        "For --policy openai: 'native' tool calls or 'hermes' <tool_call> text."))
    seed: int = Field(default=0, description="Seed of the environments' random generators.")
    backend: Literal["local", "ray"] = Field(default="local", description=(
        "Where checks run: 'local' (an evaluator in this process, this host's GPUs) or 'ray' (an evaluation pool "
        "on a Ray cluster: an actor per GPU, compile actors; needs cudagym[ray])."))
    ray_address: str | None = Field(default=None, description=(
        "With --backend ray: the cluster to run the pool on (e.g. 'auto' or 'HOST:6379'); default: a local Ray "
        "instance started for this run."))
    # contrastive feedback (CUDA-L1): each episode's prompt shows the best `contrastive` earlier
    # variants of its task (kept in <out>/variants.jsonl); episodes of one task then run in order
    contrastive: int = Field(default=0, ge=0, description=(
        "Contrastive feedback (CUDA-L1): show each episode the best K earlier measured variants of its task, with "
        "their speedups (kept in OUT/variants.jsonl); one task's episodes then run in order. 0: off."))
    require_analysis: bool = Field(default=False, description=(
        "Ask for a performance analysis in <analysis>...</analysis> before each turn's tool call."))
    analysis_reward: float = Field(default=0.0, description=(
        "Shaping reward, once per episode, for the first turn with an analysis."))

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            reject_moved(data, _MOVED, "RunConfig")
        return data


class RunSummary(BaseModel):
    out: Path
    ran: int
    skipped: int
    restarted: list[str]
    rows: list[GroupStats]
    report_md: Path
    plot: Path
    seconds: float


def default_out_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def make_policy(cfg: RunConfig) -> tuple[Policy, bool]:
    """The policy named by `cfg.policy` and whether it wants the Hermes system prompt."""
    if cfg.policy == "scripted":
        from cudagym.agent.scripted import ScriptedPolicy

        return ScriptedPolicy(cfg.solutions), True
    if cfg.policy == "openai":
        from cudagym.agent.openai_policy import OpenAIChatPolicy

        p = OpenAIChatPolicy(model=cfg.model, base_url=cfg.base_url, tool_mode=cfg.tool_mode)
        return p, p.hermes
    if ":" in cfg.policy:
        return CallablePolicy.from_spec(cfg.policy), False
    raise ConfigError(f"unknown policy {cfg.policy!r}: use scripted, openai or module:function")


def make_evaluator(cfg: RunConfig) -> Any:
    """The run's evaluator: an `Evaluator` in this process (backend ``local``), or a client of an
    evaluation pool on Ray (backend ``ray``, `cudagym.pool`), started on ``cfg.ray_address``."""
    from cudagym.rewards.evaluator import Evaluator

    if cfg.backend == "ray":
        from cudagym.pool import EvalPool, PoolConfig

        return EvalPool.start(PoolConfig(evaluator=cfg.evaluator), address=cfg.ray_address)
    return Evaluator(cfg.evaluator)


def _identity(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of `_IDENTITY` from a run's saved settings (``run.json``); in one written
    before the evaluator's settings were nested in `RunConfig.evaluator`, they are at the top."""
    def get(key: str) -> Any:
        head, _, rest = key.partition(".")
        if rest and head not in settings:
            return settings.get(rest)
        return (settings.get(head) or {}).get(rest) if rest else settings.get(head)

    return {k: get(k) for k in _IDENTITY}


def episode_ids(tasks: list[Task], episodes: int) -> list[tuple[Task, str]]:
    return [(t, f"{t.id}@{k}") for t in tasks for k in range(episodes)]


async def arun(cfg: RunConfig, console: Any = None, evaluator: Any = None) -> RunSummary:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cudagym.tasks.loaders import load_tasks

    console = console or Console()
    t0 = time.perf_counter()
    out = Path(cfg.out) if cfg.out else default_out_dir()
    store = TrajectoryStore(out)
    settings = cfg.model_dump(mode="json")
    prev = store.read_settings()
    if prev is not None:
        was, now = _identity(prev), _identity(settings)
        changed = [k for k in _IDENTITY if was[k] != now[k]]
        if changed:
            raise ConfigError(f"{out} holds a run with different {', '.join(changed)}; use another --out")
    store.write_settings(settings)
    restarted = store.clean_partials()

    tasks = load_tasks(cfg.tasks)
    if cfg.limit:
        tasks = tasks[: cfg.limit]
    plan = episode_ids(tasks, cfg.episodes)
    todo = [(t, e) for t, e in plan if not store.is_complete(e)]
    skipped = len(plan) - len(todo)

    owns_evaluator = evaluator is None
    if evaluator is None:
        evaluator = make_evaluator(cfg)
    policy, hermes = make_policy(cfg)
    counter: TokenCounter = TokenizerCounter.from_file(cfg.tokenizer) if cfg.tokenizer else CharEstimate()
    budget = ContextBudget(cfg.max_context_tokens, counter) if cfg.max_context_tokens else None
    env_cfg = EnvConfig(target=cfg.evaluator.target, mode=cfg.evaluator.mode, tolerance=cfg.tolerance,
                        max_turns=cfg.max_turns,
                        workspace_root=out / "workspaces",
                        contrastive=ContrastiveConfig(keep=cfg.contrastive, require_analysis=cfg.require_analysis,
                                                      analysis_reward=cfg.analysis_reward))
    book = VariantBook(out / "variants.jsonl") if cfg.contrastive else None
    in_order: dict[str, asyncio.Lock] = {}  # contrastive: one task's episodes (its rounds) one after another
    sem = asyncio.Semaphore(cfg.concurrency)
    console.print(f"[bold]cudagym run[/]: {len(tasks)} tasks x {cfg.episodes} episodes on target "
                  f"{evaluator.target.value if hasattr(evaluator.target, 'value') else evaluator.target}, "
                  f"policy {cfg.policy}, backend {cfg.backend}, out {out}"
                  + (f" (resuming: {skipped} done, {len(restarted)} restarted)" if prev is not None else ""))

    async def one(task: Task, eid: str, progress: Progress, bar: Any) -> None:
        rounds = in_order.setdefault(task.id, asyncio.Lock()) if book is not None else contextlib.nullcontext()
        async with rounds, sem:
            env = KernelEnv(tasks=[task], evaluator=evaluator, config=env_cfg, token_counter=counter, variant_book=book)
            writer = store.begin(eid)
            try:
                result = await run_episode(env, policy, task, eid, hermes_prompt=hermes, context=budget,
                                           on_step=writer.write, seed=cfg.seed)
            except (asyncio.CancelledError, KeyboardInterrupt):
                writer.abort()  # the run was stopped: this episode runs again on resume
                raise
            except Exception as e:  # noqa: BLE001 - one broken episode must not end the run
                result = EpisodeResult(episode_id=eid, task_id=task.id, status="error", reward=0.0, turns=0,
                                       seconds=0.0, task={"id": task.id, "source": task.source, "level": task.level},
                                       error=f"{type(e).__name__}: {e}")
            finally:
                env.close()
            if result.messages:
                writer.write({"type": "conversation", "tools": result.tools, "messages": result.messages})
            writer.commit(result.model_dump(mode="json"))
            v = result.verdict or {}
            progress.update(bar, advance=1, description=f"{eid}: {v.get('milestone', result.status)}")

    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            bar = progress.add_task("episodes", total=len(plan), completed=skipped)
            await asyncio.gather(*(one(t, e, progress, bar) for t, e in todo))
    finally:
        await policy.aclose()
        if owns_evaluator:
            evaluator.close()
    rows, md, png = write_report(out)
    return RunSummary(out=out, ran=len(todo), skipped=skipped, restarted=restarted, rows=rows, report_md=md,
                      plot=png, seconds=time.perf_counter() - t0)


def run(cfg: RunConfig, console: Any = None) -> RunSummary:
    return asyncio.run(arun(cfg, console))
