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

from pydantic import BaseModel, Field

from cudagym.agent.context import ContextBudget
from cudagym.agent.episode import EpisodeResult, run_episode
from cudagym.agent.policy import CallablePolicy, Policy
from cudagym.agent.report import GroupStats, write_report
from cudagym.agent.store import TrajectoryStore
from cudagym.env.kernel_env import EnvConfig, KernelEnv
from cudagym.env.variants import ContrastiveConfig, VariantBook
from cudagym.env.tokens import CharEstimate, TokenCounter, TokenizerCounter
from cudagym.errors import ConfigError
from cudagym.core.verdict import AuditMode
from cudagym.tasks.model import Task, Tolerance

# settings that define which episodes a run directory holds; a resume must not change them
_IDENTITY = ("tasks", "policy", "episodes", "limit", "target", "mode", "tolerance", "max_turns")


class RunConfig(BaseModel):
    tasks: str = "bundled"
    policy: str = "scripted"  # scripted | openai | module:function
    episodes: int = Field(default=1, ge=1)  # per task
    limit: int | None = Field(default=None, ge=1)  # first N tasks only
    concurrency: int = Field(default=4, ge=1)
    target: Literal["auto", "cuda", "cpu"] = "auto"
    mode: AuditMode = "strict"
    sandbox: Literal["local", "docker"] = "local"  # the sandbox backend of the run's evaluator
    tolerance: Tolerance | None = None  # None: each task's own; else this, for every task
    out: Path | None = None  # None: runs/<timestamp>
    max_turns: int = Field(default=30, ge=1)
    max_context_tokens: int | None = None
    tokenizer: Path | None = None  # a tokenizer.json for exact token counts
    solutions: Path | None = None  # scripted policy's solutions root
    model: str | None = None
    base_url: str | None = None
    tool_mode: Literal["native", "hermes"] = "native"
    seed: int = 0
    backend: Literal["local", "ray"] = "local"  # where checks run: this process, or a Ray evaluation pool
    ray_address: str | None = None  # backend ray: the cluster (None: a local Ray instance of this run)
    # contrastive feedback (CUDA-L1): each episode's prompt shows the best `contrastive` earlier
    # variants of its task (kept in <out>/variants.jsonl); episodes of one task then run in order
    contrastive: int = Field(default=0, ge=0)
    require_analysis: bool = False
    analysis_reward: float = 0.0
    server_gap_ms: tuple[float, float] | None = None  # server-mode timing beside offline (CUDA-L2): idle gaps, ms
    reward_against: tuple[str, str] | None = None  # the +2 and +3 milestones' baselines (`RewardConfig.against`)
    spare_workers: int | None = Field(default=None, ge=0)  # warm workers per device (None: the evaluator's 6 per GPU)


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
    from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
    from cudagym.rewards.milestone import RewardConfig

    config = EvaluatorConfig(target=cfg.target, mode=cfg.mode, sandbox=cfg.sandbox, server_gap_ms=cfg.server_gap_ms,
                             spare_workers=cfg.spare_workers,
                             **({"reward": RewardConfig(against=cfg.reward_against)} if cfg.reward_against else {}))
    if cfg.backend == "ray":
        from cudagym.pool import EvalPool, PoolConfig

        return EvalPool.start(PoolConfig(evaluator=config), address=cfg.ray_address)
    return Evaluator(config)


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
        changed = [k for k in _IDENTITY if prev.get(k) != settings.get(k)]
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
    env_cfg = EnvConfig(target=cfg.target, mode=cfg.mode, tolerance=cfg.tolerance, max_turns=cfg.max_turns,
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
