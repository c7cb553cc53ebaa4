"""One episode: the ReAct loop of a policy and a `KernelEnv`.

system prompt + task prompt → policy turn → env.astep(turn's action) → tool results appended
(as ``tool`` messages for native calls, as a user message of ``<tool_response>`` blocks for text
turns) → ... until the env terminates (submit) or truncates (budget). Every step is handed to
`on_step` as a JSON-able record before the next turn starts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field

from cudagym.agent.context import ContextBudget
from cudagym.agent.policy import AssistantTurn, Policy, PolicyError, TurnContext
from cudagym.agent.prompt import system_prompt, tool_response
from cudagym.env.kernel_env import KernelEnv
from cudagym.tasks.model import Task

StepHook = Callable[[dict[str, Any]], Awaitable[None] | None]


class EpisodeResult(BaseModel):
    episode_id: str
    task_id: str
    status: str  # "done" (submitted), "truncated", "policy_error"
    reward: float  # the episode's return
    turns: int
    seconds: float
    verdict: dict[str, Any] | None = None
    task: dict[str, Any] = Field(default_factory=dict)  # id, source, level, ops, target
    error: str | None = None
    usage: dict[str, int] = Field(default_factory=dict)
    # the whole conversation, untrimmed, and the tool schemas: written to the store as the
    # episode's "conversation" record (for `cudagym export sft`), not in its summary line
    messages: list[dict[str, Any]] = Field(default_factory=list, exclude=True)
    tools: list[dict[str, Any]] = Field(default_factory=list, exclude=True)


async def run_episode(
    env: KernelEnv,
    policy: Policy,
    task: Task | str,
    episode_id: str,
    *,
    hermes_prompt: bool = False,
    context: ContextBudget | None = None,
    on_step: StepHook | None = None,
    seed: int | None = None,
) -> EpisodeResult:
    t0 = time.perf_counter()
    obs, info = await env.areset(seed=seed, options={"task": task})
    tools = info["tools"]
    meta = info["task"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(meta["target"], env.config.mode, tools, hermes=hermes_prompt)},
        {"role": "user", "content": obs},
    ]
    total_reward = 0.0
    usage: dict[str, int] = {}
    turn = 0
    status, error = "truncated", None
    while True:
        ctx = TurnContext(episode_id=episode_id, task_id=meta["id"], target=meta["target"], turn=turn)
        shown = context.fit(messages) if context is not None else messages
        t_policy = time.perf_counter()
        try:
            reply: AssistantTurn = await policy.aact(shown, tools, ctx)
        except PolicyError as e:
            status, error = "policy_error", str(e)
            break
        policy_s = time.perf_counter() - t_policy
        for k, v in reply.usage.items():
            usage[k] = usage.get(k, 0) + v
        obs, reward, terminated, truncated, step_info = await env.astep(reply.action())
        total_reward += reward
        messages.append(reply.message())
        if reply.tool_calls:
            results = {r["call_id"]: r["text"] for r in step_info.get("tool_results", [])}
            for c in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": results.get(c.id, obs if len(reply.tool_calls) == 1 else "(not run)")})
            if step_info.get("parse_error") or not step_info.get("tool_results"):
                messages.append({"role": "user", "content": obs})
        else:
            messages.append({"role": "user", "content": tool_response(obs)})
        record = {
            "type": "step", "episode_id": episode_id, "turn": turn,
            "action": reply.model_dump(mode="json"), "observation": obs, "reward": reward,
            "terminated": terminated, "truncated": truncated, "policy_s": policy_s,
            "info": {k: v for k, v in step_info.items() if k != "tool_results"},
        }
        if on_step is not None:
            out = on_step(record)
            if out is not None:
                await out
        turn += 1
        if terminated or truncated:
            status = "done" if terminated else "truncated"
            break
    verdict = env.verdict.summary() if env.verdict is not None else None
    return EpisodeResult(episode_id=episode_id, task_id=meta["id"], status=status, reward=total_reward, turns=turn,
                         seconds=time.perf_counter() - t0, verdict=verdict, task=meta, error=error, usage=usage,
                         messages=messages, tools=tools)
