"""GRPO on `KernelEnv` with TRL (pinned: trl 1.16.0), through its ``rollout_func`` hook.

TRL 1.16's `GRPOTrainer` has two multi-turn hooks. ``environment_factory`` exposes an object's
methods as tools and parses tool calls with the tokenizer's response schema (known chat templates
only); each tool result becomes a ``tool`` message. ``rollout_func(prompts, trainer)`` hands the
whole rollout to the caller, who returns ``prompt_ids``, ``completion_ids``, ``logprobs`` and,
optionally, ``env_mask`` (1 = the model's tokens, 0 = tokens it did not write: TRL drops them from
the loss) plus any extra fields, which reach the reward functions as keyword arguments. This
adapter is a ``rollout_func``, because the episode must be KernelEnv's own: its parser (Hermes
``<tool_call>`` text, any tokenizer), its turn and token budgets, its milestone reward, and
scoring at truncation. How to use it::

    rollout = KernelRollout(tasks="bundled", tokenizer=tok, env_config=EnvConfig(target="cpu"),
                            config=RolloutConfig(max_tokens=131072))
    trainer = GRPOTrainer(model=model, args=GRPOConfig(...), processing_class=tok,
                          train_dataset=rollout.dataset(), reward_funcs=rollout.reward_funcs(),
                          rollout_func=rollout)

One rollout, for each prompt TRL hands over (its sampler already repeats each prompt
``num_generations`` times, one episode each):

1. a fresh `KernelEnv` (one shared evaluator) is reset on the row's task; the prompt is the
   policy's system prompt (Hermes tool format) and the env's task prompt, rendered with the
   tokenizer's chat template; the env is told the exact prompt length and the episode's budget,
   the smallest of ``RolloutConfig.max_tokens``, ``EnvConfig.max_tokens`` and the prompt plus
   ``GRPOConfig.max_completion_length``; the env's ``message_overhead_tokens`` is raised to what
   the template adds around an observation (measured once), so its count never falls short;
2. all live episodes generate their next turn in one batch through the trainer's own generation
   path (transformers ``generate`` or vLLM, as the ``GRPOConfig`` says; the per-turn limit is
   ``generation_kwargs={"max_new_tokens": N}``, else ``max_completion_length``), cut to what is
   left of the budget;
3. the decoded turns step their envs concurrently (``astep``, with the exact token count of each
   turn); the observation comes back already fitted into the budget by the env, and is appended
   as a user message ``<tool_response>...</tool_response>`` rendered by the chat template, its
   tokens masked out (``env_mask`` 0);
4. until submit (terminated), the turn or token budget (truncated, the workspace scored as it
   stands) -- the last observation is not appended (nothing is generated after it).

Rewards: ``milestone_reward`` (the verdict's, -1..+3) and ``shaping_reward`` (the env's shaping:
format / tool-use and milestone shaping, `cudagym.env.ShapingConfig`) are separate TRL reward
functions, so TRL logs each. ``guided_per_group`` lets a cudagym `Policy` (the scripted
solutions, a stronger model behind an OpenAI endpoint) play the first k episodes of each group;
their turns are trained on like the policy's own (off-policy, with NaN sampling log-probs under
vLLM's importance-sampling correction, which makes their ratio 1).

Not supported: the ``environment_factory`` hook. In TRL 1.16 it parses tool calls with a response
schema that TRL knows only for some chat templates, keeps calling tools for as long as the model
emits calls (a ``submit`` cannot end the episode), and drops a tool result that would pass
``max_completion_length`` instead of trimming it, ending the sample without the env's scoring;
KernelEnv's protocol, budget and truncation do not map onto it. Also not supported: several
processes with vLLM in server mode (each turn is one ``generate`` call per process, and processes
that run different numbers of turns would wait on each other: untested); images. The turn-level generation goes through
`GRPOTrainer._generate_single_turn`, a private method of the pinned TRL.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from cudagym.agent.policy import Policy, TurnContext
from cudagym.agent.prompt import system_prompt, tool_response
from cudagym.env.kernel_env import EnvConfig, KernelEnv, _as_tasks
from cudagym.env.tokens import TokenizerCounter
from cudagym.env.tools import Toolbox
from cudagym.errors import ConfigError
from cudagym.rewards.api import EvaluatorAPI
from cudagym.sandbox.bridge import run_sync
from cudagym.tasks.model import Target, Task
from cudagym.train.template import OBSERVATION_MARGIN_TOKENS, observation_ids, observation_overhead, render

_TASK_ID = re.compile(r"^Task id: ([^;\n]+);", re.MULTILINE)  # cudagym.env.prompt.task_prompt's line


class RolloutConfig(BaseModel):
    """The adapter's own knobs (the env's are `EnvConfig`, the trainer's `GRPOConfig`)."""

    max_tokens: int | None = Field(default=None, ge=1)  # prompt + completion per episode (131072: 128K); None: no cap
    # beyond the prompt + GRPOConfig.max_completion_length
    guided_per_group: int = Field(default=0, ge=0)  # episodes of each group played by `guide`
    # added to the measured template overhead
    observation_margin_tokens: int = Field(default=OBSERVATION_MARGIN_TOKENS, ge=0)


@dataclass
class _Episode:
    env: KernelEnv
    task_id: str
    guided: bool
    prompt_ids: list[int]
    budget: int | None
    messages: list[dict[str, Any]]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    truncated_by: str | None = None
    reasons: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    parse_errors: int = 0
    tool_seconds: dict[str, float] = field(default_factory=dict)  # per tool: seconds its calls took

    def left(self) -> int | None:
        return None if self.budget is None else self.budget - len(self.prompt_ids) - len(self.completion_ids)


class KernelRollout:
    """TRL's ``rollout_func`` playing KernelEnv episodes (see the module's text)."""

    def __init__(
        self,
        tasks: list[Task] | Task | str | None = "bundled",
        *,
        tokenizer: Any,
        env_config: EnvConfig | None = None,
        config: RolloutConfig | None = None,
        evaluator: EvaluatorAPI | None = None,
        guide: Policy | None = None,
    ) -> None:
        self.tasks = _as_tasks(tasks)
        if not self.tasks:
            raise ConfigError("KernelRollout needs at least one task")
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        if self.config.guided_per_group and guide is None:
            raise ConfigError("guided_per_group > 0 needs a guide policy")
        self.guide = guide
        self.counter = TokenizerCounter(tokenizer)
        env_config = env_config or EnvConfig()
        self._owns_evaluator = evaluator is None
        if evaluator is None:
            from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig

            evaluator = Evaluator(EvaluatorConfig(target=env_config.target, mode=env_config.mode))
        self.evaluator = evaluator
        self.target = Target(evaluator.target).value
        overhead = observation_overhead(tokenizer, self.counter.count) + self.config.observation_margin_tokens
        self.env_config = env_config.model_copy(update={
            "target": self.target,
            "message_overhead_tokens": max(env_config.message_overhead_tokens, overhead)})
        self.tools = Toolbox().schemas()
        self.system = system_prompt(self.target, self.env_config.mode, self.tools, hermes=True)
        self._loop = asyncio.new_event_loop()

    # -- data and rewards ----------------------------------------------------------------------
    def dataset(self, repeat: int = 1) -> Any:
        """A `datasets.Dataset` of conversational prompts, one row per task (times `repeat`):
        ``prompt`` (the system prompt and the task prompt) and ``task_id``."""
        from datasets import Dataset

        from cudagym.env.prompt import task_prompt

        rows = []
        for t in self.tasks:
            sized = t.for_target(Target(self.target))
            rows.append({"prompt": [{"role": "system", "content": self.system},
                                    {"role": "user", "content": task_prompt(sized, Target(self.target))}],
                         "task_id": t.id})
        return Dataset.from_list(rows * repeat)

    def reward_funcs(self) -> list[Any]:
        """TRL reward functions: the milestone reward, and the shaping reward when any is set."""
        sh = self.env_config.shaping
        shaped = any(getattr(sh, k) for k in ("first_compile", "first_correct", "well_formed_turn", "malformed_turn"))
        shaped = shaped or bool(self.env_config.contrastive.analysis_reward)
        return [milestone_reward, shaping_reward] if shaped else [milestone_reward]

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        return run_sync(self.arollout(prompts, trainer), self._loop, async_form="await hook.arollout(prompts, trainer)")

    async def arollout(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        limit = trainer.max_completion_length
        episodes: list[_Episode] = []
        for i, prompt in enumerate(prompts):
            episodes.append(await self._start(self._task_id(prompt), i % group < self.config.guided_per_group, limit))
        try:
            while live := [e for e in episodes if not e.done]:
                await self._turn(live, trainer)
        finally:
            for e in episodes:
                e.env.close()
        use_logprobs = bool(getattr(trainer, "use_vllm", False))
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.completion_ids for e in episodes],
            "logprobs": [e.logprobs for e in episodes] if use_logprobs else None,
            "env_mask": [e.mask for e in episodes],
            "milestone_reward": [self._milestone(e) for e in episodes],
            "shaping_reward": [e.reward - self._milestone(e) for e in episodes],
            "episode": [self._summary(e) for e in episodes],
        }

    async def _start(self, task_id: str, guided: bool, completion_limit: int | None) -> _Episode:
        env = KernelEnv(tasks=self.tasks, evaluator=self.evaluator, config=self.env_config, token_counter=self.counter)
        obs, _ = await env.areset(options={"task": task_id})
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": obs}]
        prompt_ids = render(self.tokenizer, messages, add_generation_prompt=True)
        caps = [c for c in (self.config.max_tokens, self.env_config.max_tokens,
                            None if completion_limit is None else len(prompt_ids) + completion_limit) if c]
        budget = min(caps) if caps else None
        env.declare_prompt(len(prompt_ids), budget)
        return _Episode(env=env, task_id=task_id, guided=guided, prompt_ids=prompt_ids, budget=budget,
                        messages=messages)

    async def _turn(self, live: list[_Episode], trainer: Any) -> None:
        sampled = [e for e in live if not e.guided]
        turns: dict[int, tuple[list[int], list[float] | None]] = {}
        if sampled:
            # TRL has no public single-turn call
            ids, logprobs = trainer._generate_single_turn(  # noqa: SLF001
                [e.prompt_ids + e.completion_ids for e in sampled], None, {}, num_generations=1)
            for k, e in enumerate(sampled):
                turns[id(e)] = (list(ids[k]), None if logprobs is None else list(logprobs[k]))
        for e in live:
            if e.guided:
                turns[id(e)] = (await self._guided_turn(e), None)

        eos = self.tokenizer.eos_token_id
        steps = []
        for e in live:
            ids, lps = turns[id(e)]
            left = e.left()
            if left is not None and len(ids) > left:  # the budget ends inside this turn
                ids, lps = ids[:max(left, 0)], None if lps is None else lps[:max(left, 0)]
            e.completion_ids += ids
            e.mask += [1] * len(ids)
            e.logprobs += lps if lps is not None else [math.nan] * len(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": text})
            steps.append(e.env.astep(text, action_tokens=len(ids)))
        results = await asyncio.gather(*steps)

        for e, (obs, reward, terminated, truncated, info) in zip(live, results):
            e.turns += 1
            e.reward += reward
            e.reasons += info.get("reward_reasons", [])
            e.tool_calls += len(info.get("calls", []))
            e.tool_errors += sum(not c["ok"] for c in info.get("calls", []))
            e.parse_errors += bool(info.get("parse_error"))
            for c in info.get("calls", []):
                e.tool_seconds[c["name"]] = e.tool_seconds.get(c["name"], 0.0) + c["seconds"]
            if terminated or truncated:
                e.done, e.terminated, e.truncated = True, terminated, truncated
                e.truncated_by = info.get("truncated_by")
                continue
            suffix = observation_ids(self.tokenizer, obs)
            if e.completion_ids and e.completion_ids[-1] != eos:
                suffix = [eos] + suffix  # the turn was cut: close it as the template would
            left = e.left()
            if left is not None and len(suffix) > left:  # the env counted less than the template adds
                e.done, e.truncated, e.truncated_by = True, True, "tokens"
                e.reasons.append("the observation did not fit the budget as tokenized; not appended, not scored")
                continue
            e.completion_ids += suffix
            e.mask += [0] * len(suffix)
            e.logprobs += [0.0] * len(suffix)
            e.messages.append({"role": "user", "content": tool_response(obs)})

    async def _guided_turn(self, e: _Episode) -> list[int]:
        assert self.guide is not None  # noqa: S101 - guided episodes exist only with a guide (checked in __init__)
        ctx = TurnContext(episode_id=f"trl-{uuid.uuid4().hex[:8]}", task_id=e.task_id, target=self.target, turn=e.turns)
        turn = await self.guide.aact(e.messages, self.tools, ctx)
        text = turn.content
        for c in turn.tool_calls:  # native calls become Hermes text, the format this adapter trains
            text += f"\n<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]

    # -- helpers -------------------------------------------------------------------------------
    def _task_id(self, prompt: Any) -> str:
        text = prompt if isinstance(prompt, str) else "\n".join(
            m.get("content") or "" for m in prompt if m.get("role") == "user")
        m = _TASK_ID.search(text)
        if m is None:
            raise ConfigError("a prompt without a cudagym task line ('Task id: ...;'): build the dataset with "
                              "KernelRollout.dataset()")
        return m.group(1).strip()

    @staticmethod
    def _milestone(e: _Episode) -> float:
        return float(e.env.verdict.reward) if e.env.verdict is not None else 0.0

    def _summary(self, e: _Episode) -> dict[str, Any]:
        v = e.env.verdict
        return {"task_id": e.task_id, "guided": e.guided, "turns": e.turns, "terminated": e.terminated,
                "truncated": e.truncated, "truncated_by": e.truncated_by,
                "tokens": len(e.prompt_ids) + len(e.completion_ids),
                "budget": e.budget, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
                "parse_errors": e.parse_errors, "tool_seconds": dict(e.tool_seconds),
                "milestone": v.milestone if v is not None else None,
                "reasons": list(e.reasons)}

    def close(self) -> None:
        if self._owns_evaluator:
            self.evaluator.close()
            self._owns_evaluator = False
        if not self._loop.is_closed():
            self._loop.close()


def milestone_reward(completions: list[Any], milestone_reward: list[float], episode: list[dict[str, Any]] | None = None,
                     log_metric: Any = None, **_: Any) -> list[float]:
    """TRL reward function: each episode's milestone reward (its verdict's; 0 when unscored).
    Logs per-batch episode metrics (turns, tool calls and errors, truncations, submits)."""
    if log_metric is not None and episode:
        n = len(episode)
        log_metric("cudagym/turns", sum(e["turns"] for e in episode) / n)
        log_metric("cudagym/tool_calls", sum(e["tool_calls"] for e in episode) / n)
        log_metric("cudagym/tool_errors", sum(e["tool_errors"] for e in episode) / n)
        log_metric("cudagym/parse_errors", sum(e["parse_errors"] for e in episode) / n)
        log_metric("cudagym/submitted", sum(e["terminated"] for e in episode) / n)
        log_metric("cudagym/truncated_by_tokens", sum(e["truncated_by"] == "tokens" for e in episode) / n)
    return [float(r) for r in milestone_reward]


def shaping_reward(completions: list[Any], shaping_reward: list[float], **_: Any) -> list[float]:
    """TRL reward function: each episode's shaping reward (format / tool use, milestones reached)."""
    return [float(r) for r in shaping_reward]
