"""`KernelEnv`: the Gymnasium ReAct environment of one kernel-optimization episode.

Contract
--------
- ``reset(seed=None, options={"task": <id or Task>})`` starts an episode in a fresh workspace
  (``model.py`` = the reference, read-only) and returns ``(prompt, info)``: the task prompt, and
  in ``info`` the tool schemas (``"tools"``, OpenAI function-calling format), the task's
  metadata (``"task"``, with the tolerance its outputs are checked with), the workspace path
  and the budgets. ``EnvConfig.tolerance`` (the ``tolerance=`` option of the constructor and of
  ``gymnasium.make``), when set, replaces every task's tolerance. Without a task option the task is
  drawn from the env's task list with the env's RNG (seeded by ``seed``).
- ``step(action)`` takes text (an LLM turn with ``<tool_call>{...}</tool_call>`` blocks or one
  bare JSON call) or a structured call (a `ToolCall`, a ``{"name", "arguments"}`` dict, or a list
  of those), runs the calls in order and returns ``(observation, reward, terminated, truncated,
  info)``:
  * observation: the tool results as text, each headed ``[tool]``, long output trimmed to
    ``max_observation_chars`` keeping error lines. A malformed action, an unknown tool, bad
    arguments or a refused file operation is an error observation; the episode goes on.
    With a token budget (``max_tokens``), the observation is also fitted into what is left of
    it (see *Token budget* below).
  * reward: the milestone reward of the verdict at ``submit`` (or at truncation when
    ``score_on_truncation``), plus shaping rewards if configured; 0 otherwise.
  * terminated: the agent submitted. truncated: the turn or token budget ran out
    (``info["truncated_by"]`` says which).
  * info: ``calls`` (per call: name, ok, seconds, error), ``tool_results`` (per call text),
    ``verdict`` (summary dict, at the end), ``reward_reasons``, ``timings`` and ``metrics``
    (per-tool calls/errors/seconds so far).
- Token budget (``EnvConfig.max_tokens``, e.g. 131072 for a 128K-context trainer): the whole
  episode as the policy sees it -- the prompt, every action, every observation, plus
  ``message_overhead_tokens`` per action and per observation (what the caller's chat template
  adds around a message) -- counted with ``token_counter`` (pass the trainer's own tokenizer in a
  `TokenizerCounter`; the default is a 4-chars-a-token estimate). After ``reset``, a trainer may
  call ``declare_prompt(tokens, max_tokens=None)`` with its exact count of the prompt it rendered
  (system prompt, tool schemas, chat template around the task prompt), which replaces the env's
  own count of the task prompt, and with this episode's budget if it differs from the config's
  (say, the prompt plus the trainer's completion limit). An observation that would not fit in what is
  left is trimmed to fit: the tool outputs (compile logs, profiles, file reads, notes) share the
  room, the longest trimmed first, each keeping its error lines, head and tail
  (`cudagym.env.format.trim_output`); the protocol is never cut: every call keeps its ``[tool]``
  header and its entry in ``info["tool_results"]`` (same order, same call ids), and the final
  verdict's first line stays. When an observation had to be trimmed, or fewer than
  ``min_turn_tokens`` are left, the episode ends with ``truncated=True``,
  ``truncated_by="tokens"`` (scored as it stands when ``score_on_truncation``). Only an action
  longer than what is left, or a budget smaller than the bare headers, can overshoot it.
  ``info["tokens"]`` is the count so far, ``info["tokens_left"]`` what is left,
  ``info["observation_trimmed"]`` whether this observation was fitted. ``step(action,
  action_tokens=n)`` (and ``astep``) take a trainer's exact length of the action in its sequence.
  Without ``max_tokens`` (the default) nothing of this applies.
- ``areset``/``astep`` are the async forms (for trainers running many episodes in one event
  loop); ``reset``/``step`` run them on the env's private event loop.
- The env owns its `Evaluator` unless one is injected (then it is shared and not closed here):
  anything with the evaluator's methods (`cudagym.rewards.api.EvaluatorAPI`), such as a Ray
  evaluation pool's client (`cudagym.pool.EvalPool`), which this module never imports.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
from gymnasium.spaces import Text
from pydantic import BaseModel, ConfigDict, Field

from cudagym.env.parsing import parse_action
from cudagym.env.prompt import task_prompt
from cudagym.env.tokens import CharEstimate, TokenCounter
from cudagym.env.tools import ToolContext, Toolbox, ToolResult
from cudagym.env.variants import (ContrastiveConfig, VariantBook, analysis_instruction, has_analysis,
                                  variant_from_result)
from cudagym.env.format import format_verdict, trim_output
from cudagym.errors import ConfigError
from cudagym.rewards.api import EvaluatorAPI
from cudagym.core.verdict import AuditMode, ErrorKind, Verdict
from cudagym.sandbox.bridge import run_sync
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target, Task, Tolerance

MAX_TEXT_CHARS = 1 << 20


class UnicodeText(Text):
    """A `Text` space over all of Unicode.

    Membership accepts any string of allowed length made of Unicode scalar values (no lone
    surrogates); sampling draws from printable ASCII plus newline and tab (a charset of all
    1.1M code points would cost seconds to build per env).
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None) -> None:
        import string

        super().__init__(max_length, min_length=min_length, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        if not isinstance(x, str) or not (self.min_length <= len(x) <= self.max_length):
            return False
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"


class ShapingConfig(BaseModel):
    """Optional intermediate rewards, added to the step's reward (all 0: off, the default).

    Milestone shaping is paid once per episode. Format shaping gives a fresh policy, which rarely
    gets as far as a compile, a signal to learn the tool-call protocol from: a turn is
    *well formed* when it parsed without error into at least one call and every call names a
    tool with valid arguments (whether the tool then succeeds or not). Well-formed turns are
    paid ``well_formed_turn`` each, up to ``well_formed_cap`` in all per episode (so that calling
    ``list_files`` forever is not a strategy); other turns pay ``malformed_turn`` each (set it
    below 0 to penalize them). Every payment is named in ``info["reward_reasons"]``.
    """

    first_compile: float = 0.0  # the first successful compile
    first_correct: float = 0.0  # the first passing verify
    well_formed_turn: float = 0.0  # per well-formed turn, up to well_formed_cap per episode
    well_formed_cap: float = Field(default=0.5, ge=0.0)
    malformed_turn: float = 0.0  # per malformed turn (no call, bad JSON, unknown tool, bad arguments)


class EnvConfig(BaseModel):
    """Budgets and options of `KernelEnv` (the evaluator has its own `EvaluatorConfig`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    target: Literal["auto", "cuda", "cpu"] = "auto"
    mode: AuditMode = "strict"
    sandbox: Literal["local", "docker"] = "local"  # the evaluator's sandbox backend, when the env makes it
    tolerance: Tolerance | None = None  # None: each task's own (`Task.effective_tolerance`); else this, for every task
    max_turns: int = Field(default=30, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)  # prompt + actions + observations, whole episode
    message_overhead_tokens: int = Field(default=0, ge=0)  # a chat template's tokens around each action / observation
    min_turn_tokens: int = Field(default=1, ge=1)  # truncate when fewer tokens than this are left
    max_observation_chars: int = Field(default=8000, ge=200)  # per tool result
    max_calls_per_turn: int = Field(default=8, ge=1)
    workspace_root: Path | None = None  # None: a temp dir per episode
    keep_workspaces: bool = False
    score_on_truncation: bool = True
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    contrastive: ContrastiveConfig = Field(default_factory=ContrastiveConfig)  # CUDA-L1 feedback (off by default)


class KernelEnv(gym.Env[str, Any]):
    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        tasks: list[Task] | Task | str | None = None,
        target: Literal["auto", "cuda", "cpu"] | None = None,
        mode: AuditMode | None = None,
        *,
        config: EnvConfig | None = None,
        evaluator: EvaluatorAPI | None = None,
        token_counter: TokenCounter | None = None,
        variant_book: VariantBook | None = None,
        render_mode: str | None = None,
        **overrides: Any,
    ) -> None:
        fields = {**(config or EnvConfig()).model_dump(), **overrides}  # validated below, dicts and all
        if target is not None:
            fields["target"] = target
        if mode is not None:
            fields["mode"] = mode
        self.config = EnvConfig.model_validate(fields)
        self.render_mode = render_mode
        self.tasks = _as_tasks(tasks)
        if not self.tasks:
            raise ConfigError("KernelEnv needs at least one task")
        self._owns_evaluator = evaluator is None
        if evaluator is None:
            from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig

            evaluator = Evaluator(EvaluatorConfig.model_validate(
                {"target": self.config.target, "mode": self.config.mode, "sandbox": self.config.sandbox}))
        self.evaluator = evaluator
        self.target: Target = Target(evaluator.target)
        self.toolbox = Toolbox()
        self.counter: TokenCounter = token_counter or CharEstimate()
        self.observation_space = UnicodeText(MAX_TEXT_CHARS)
        self.action_space = UnicodeText(MAX_TEXT_CHARS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: ToolContext | None = None
        self._workspace_dir: Path | None = None
        self._turn = 0
        self._tokens = 0
        self._done = True
        self._shaped: set[str] = set()
        self._format_paid = 0.0
        self._budget: int | None = self.config.max_tokens  # this episode's (see declare_prompt)
        self._last_obs = ""
        self.verdict: Verdict | None = None
        # contrastive feedback: an injected book is shared (several envs, one trainer)
        self.variants = variant_book or VariantBook(self.config.contrastive.book, self.config.contrastive.limits)
        self._episode_id = ""

    # -- properties ----------------------------------------------------------------------------
    @property
    def task(self) -> Task | None:
        return self._ctx.task if self._ctx else None

    @property
    def workspace(self) -> Workspace | None:
        return self._ctx.workspace if self._ctx else None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas()

    # -- async API -----------------------------------------------------------------------------
    async def areset(self, *, seed: int | None = None,
                     options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._cleanup_workspace()
        task = self._pick_task((options or {}).get("task"))
        task = task.for_target(self.target)
        if self.config.tolerance is not None:
            task = task.model_copy(update={"tolerance": self.config.tolerance})
        self._workspace_dir = self._new_workspace_dir(task.id)
        ws = Workspace.create(self._workspace_dir, task)
        self._ctx = ToolContext(task=task, workspace=ws, evaluator=self.evaluator,
                                max_output_chars=self.config.max_observation_chars,
                                book_limits=self.config.contrastive.limits)
        self._turn = 0
        self._done = False
        self._shaped = set()
        self._format_paid = 0.0
        self.verdict = None
        self._episode_id = uuid.uuid4().hex[:12]
        prompt = task_prompt(task, self.target)
        con = self.config.contrastive
        if con.keep:
            earlier = self.variants.render(task.id, con.keep, con.max_variant_chars)
            if earlier:
                prompt += "\n\n" + earlier
        if con.require_analysis:
            prompt += "\n\n" + analysis_instruction()
        self._tokens = self.counter.count(prompt)
        self._budget = self.config.max_tokens
        self._last_obs = prompt
        info = {
            "tools": self.tool_schemas(),
            "task": {
                "id": task.id, "source": task.source, "level": task.level, "ops": list(task.ops),
                "dtype": task.dtype, "target": self.target.value, "sizes": task.sizes,
                "tolerance": task.effective_tolerance.model_dump(),
            },
            "workspace": str(ws.root),
            "max_turns": self.config.max_turns,
            "max_tokens": self.config.max_tokens,
            "tokens": self._tokens,
            "mode": self.config.mode,
        }
        return prompt, info

    async def astep(self, action: Any, *,
                    action_tokens: int | None = None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`step`'s async form; `action_tokens` is the caller's exact token count of the action as
        it sits in the sequence (as generated, with any template tokens around it: a trainer knows
        it, and re-tokenizing decoded text can differ), replacing the env's count of its text plus
        ``message_overhead_tokens``."""
        t0 = time.perf_counter()
        if self._ctx is None or self._done:
            msg = "Error: the episode is over (or was never started); call reset() to begin a new one."
            return msg, 0.0, True, False, {"error": "episode_over"}
        ctx = self._ctx
        self._turn += 1
        parsed = parse_action(action)
        results: list[ToolResult] = []
        notes: list[str] = []
        if parsed.error:
            notes.append(f"Error: {parsed.error}")
        calls = parsed.calls
        if len(calls) > self.config.max_calls_per_turn:
            notes.append(f"Error: at most {self.config.max_calls_per_turn} tool calls per turn; "
                         f"the last {len(calls) - self.config.max_calls_per_turn} were not run.")
            calls = calls[: self.config.max_calls_per_turn]
        terminated = False
        for i, call in enumerate(calls):
            result = await self.toolbox.run(ctx, call)
            results.append(result)
            if result.terminal:
                terminated = True
                if i + 1 < len(calls):
                    notes.append(f"Note: {len(calls) - i - 1} call(s) after submit were not run.")
                break

        reward = 0.0
        reasons: list[str] = []
        reward += self._format_shaping(parsed.error is None and bool(parsed.calls)
                                       and all(self.toolbox.accepts(c) for c in parsed.calls), reasons)
        for r in results:  # shaping, paid once per milestone
            if r.name == "compile" and r.ok and "compile" not in self._shaped and self.config.shaping.first_compile:
                self._shaped.add("compile")
                reward += self.config.shaping.first_compile
                reasons.append(f"shaping: first successful compile {self.config.shaping.first_compile:+g}")
            if r.name == "verify" and r.ok and "verify" not in self._shaped and self.config.shaping.first_correct:
                self._shaped.add("verify")
                reward += self.config.shaping.first_correct
                reasons.append(f"shaping: first passing verify {self.config.shaping.first_correct:+g}")
        verdict = next((r.verdict for r in results if r.verdict is not None), None)
        reward += self._contrastive(ctx, parsed.text, results, notes, reasons)

        texts = [r.text for r in results]
        overhead = self.config.message_overhead_tokens
        self._tokens += self.counter.count(parsed.text) + overhead if action_tokens is None else action_tokens
        budget = self._budget
        room = None if budget is None else budget - self._tokens - overhead  # for this observation
        obs = self._compose(results, texts, notes)
        trimmed = room is not None and self.counter.count(obs) > room
        truncated_by = None
        if not terminated:
            if trimmed or (room is not None and room - self.counter.count(obs) < self.config.min_turn_tokens):
                truncated_by = "tokens"
            elif self._turn >= self.config.max_turns:
                truncated_by = "turns"
        truncated = truncated_by is not None
        tail = ""
        if truncated and self.config.score_on_truncation:
            verdict = await self._final_verdict()
            tail = (f"The {'turn' if truncated_by == 'turns' else 'token'} budget is used up; the workspace "
                    f"was scored as it stands.\n" + format_verdict(verdict, self.config.max_observation_chars))
        elif truncated:
            tail = f"The {'turn' if truncated_by == 'turns' else 'token'} budget is used up."
        if room is not None:
            obs, texts, trimmed = self._fit(results, texts, notes, tail, room)
        else:
            obs = self._compose(results, texts, notes, tail)
        self._tokens += self.counter.count(obs) + overhead
        if verdict is not None:
            reward += verdict.reward
            reasons.extend(verdict.reasons)
            self.verdict = verdict
        self._done = terminated or truncated
        obs = obs[: MAX_TEXT_CHARS]
        self._last_obs = obs
        info = {
            "turn": self._turn,
            "task_id": ctx.task.id,
            "calls": [{"name": r.name, "ok": r.ok, "seconds": round(r.seconds, 6), "error": r.error,
                       "call_id": r.call_id, **({"internal": r.data["internal"]} if "internal" in r.data else {})}
                      for r in results],
            "tool_results": [{"name": r.name, "call_id": r.call_id, "ok": r.ok, "text": t}
                             for r, t in zip(results, texts)],
            "parse_error": parsed.error,
            "verdict": verdict.summary() if verdict is not None else None,
            "reward_reasons": reasons,
            "timings": {"step_s": time.perf_counter() - t0, **{f"{r.name}_s": r.seconds for r in results}},
            "metrics": {k: dict(v) for k, v in ctx.counters.items()},
            "tokens": self._tokens,
            "tokens_left": None if budget is None else budget - self._tokens,
            "observation_trimmed": trimmed,
            "truncated_by": truncated_by,
        }
        return obs, float(reward), terminated, truncated, info

    def declare_prompt(self, tokens: int, max_tokens: int | None = None) -> None:
        """The caller's exact token count of the prompt it rendered for this episode (replacing the
        env's count of the task prompt) and, if given, this episode's token budget (replacing
        ``config.max_tokens`` until the next reset). Call it after ``reset``, before the first step."""
        if self._ctx is None or self._done or self._turn:
            raise RuntimeError("declare_prompt() belongs between reset() and the first step()")
        if tokens < 0 or (max_tokens is not None and max_tokens < 1):
            raise ConfigError(f"declare_prompt: tokens={tokens}, max_tokens={max_tokens}")
        self._tokens = int(tokens)
        if max_tokens is not None:
            self._budget = int(max_tokens)

    async def _final_verdict(self) -> Verdict:
        assert self._ctx is not None  # noqa: S101 - called only inside an episode
        try:
            return await self.evaluator.aevaluate(self._ctx.task, self._ctx.workspace, profiled=self._ctx.profiles)
        except Exception as e:  # noqa: BLE001 - a harness failure is not the agent's to see or pay for
            return Verdict(reward=0.0, milestone="failed", compiled=False, correct=False,
                           reasons=[f"internal error while scoring: {type(e).__name__}"],
                           error=f"{type(e).__name__}: {e}", error_kind=ErrorKind.INTERNAL)

    def _contrastive(self, ctx: ToolContext, text: str, results: list[ToolResult], notes: list[str],
                     reasons: list[str]) -> float:
        """Record the turn's measured variants; the analysis check and its shaping reward."""
        con = self.config.contrastive
        if not con.keep and not con.require_analysis:
            return 0.0
        measured = False
        for r in results if con.keep else []:
            if r.measured is None:  # only the files a tool read before its jobs ran are what they measured
                continue
            v = variant_from_result(ctx.task.id, self._episode_id, self._turn, r.measured, r.data)
            if v is not None:
                self.variants.add(v)
                measured = measured or r.name == "profile"
        if measured and con.in_episode:
            block = self.variants.render(ctx.task.id, con.keep, con.max_variant_chars, episode=self._episode_id,
                                         title="Variants of this episode so far")
            notes.append(block)
        reward = 0.0
        if con.require_analysis:
            if has_analysis(text):
                if "analysis" not in self._shaped and con.analysis_reward:
                    self._shaped.add("analysis")
                    reward = con.analysis_reward
                    reasons.append(f"shaping: first performance analysis {con.analysis_reward:+g}")
            else:
                notes.append("Note: this turn had no <analysis>...</analysis> before its tool call (asked for).")
        return reward

    def _format_shaping(self, well_formed: bool, reasons: list[str]) -> float:
        sh = self.config.shaping
        if well_formed and sh.well_formed_turn:
            pay = min(sh.well_formed_turn, max(sh.well_formed_cap - self._format_paid, 0.0))
            if pay:
                self._format_paid += pay
                reasons.append(f"shaping: well-formed tool call {pay:+g}")
            return pay
        if not well_formed and sh.malformed_turn:
            reasons.append(f"shaping: malformed turn {sh.malformed_turn:+g}")
            return sh.malformed_turn
        return 0.0

    def _compose(self, results: list[ToolResult], texts: list[str], notes: list[str], tail: str = "") -> str:
        """The observation: one ``[tool]``-headed part per result, then the notes, then `tail`."""
        cap = self.config.max_observation_chars  # per part, so that no part loses its header
        parts = [trim_output(f"[{r.name}] {t}", cap) for r, t in zip(results, texts)]
        parts.extend(trim_output(n, cap) for n in notes)
        if not parts:
            parts.append("Error: no tool call was run.")
        body = "\n\n".join(parts)
        return f"{body}\n\n{tail}" if tail else body

    def _fit(self, results: list[ToolResult], texts: list[str], notes: list[str], tail: str,
             room: int) -> tuple[str, list[str], bool]:
        """The observation fitted into `room` tokens, the results' texts as fitted, and whether
        anything was trimmed (see *Token budget* in the module's text)."""
        count = self.counter.count
        obs = self._compose(results, texts, notes, tail)
        if count(obs) <= room:
            return obs, texts, False
        note = f"[tool output trimmed to fit the episode's token budget of {self._budget} tokens]"
        lines = tail.split("\n", 2)  # the budget line and the verdict's first line stay whole
        tail_head, tail_rest = "\n".join(lines[:2]), (lines[2] if len(lines) > 2 else "")
        items = [*texts, *notes, tail_rest]  # what may shrink; headers, the note and tail_head stay
        sizes = [count(x) for x in items]
        slack = 0
        for _ in range(12):
            fixed = count(self._compose(results, [""] * len(texts), [""] * len(notes), f"{tail_head}\n{note}"))
            shares = _water_fill(sizes, room - fixed - slack - 2 * len(items))
            fitted = [x if size <= share else _trim_to_tokens(x, share, count)
                      for x, size, share in zip(items, sizes, shares)]
            new_texts, new_notes = fitted[: len(texts)], fitted[len(texts): len(texts) + len(notes)]
            new_tail = "\n".join(x for x in (tail_head, fitted[-1], note) if x)
            obs = self._compose(results, new_texts, [n for n in new_notes if n], new_tail)
            over = count(obs) - room
            if over <= 0:
                return obs, new_texts, True
            slack += max(over, 8) * 2
        # a budget smaller than the bare protocol: headers and the tail's first line only
        return self._compose(results, [""] * len(texts), [], f"{tail_head}\n{note}".strip()), [""] * len(texts), True

    # -- sync API ------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action: Any, *, action_tokens: int | None = None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._run(self.astep(action, action_tokens=action_tokens))

    def render(self) -> str | None:
        return self._last_obs if self.render_mode == "ansi" else None

    def close(self) -> None:
        self._cleanup_workspace()
        self._ctx = None
        if self._owns_evaluator and self.evaluator is not None:
            self.evaluator.close()
            self._owns_evaluator = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    def _run(self, coro: Any) -> Any:
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return run_sync(coro, self._loop, async_form="await env.areset/astep (KernelEnv.reset/step are the sync forms)")

    # -- helpers -------------------------------------------------------------------------------
    def _pick_task(self, choice: Any) -> Task:
        if isinstance(choice, Task):
            return choice
        if isinstance(choice, str):
            for t in self.tasks:
                if t.id == choice:
                    return t
            try:
                from cudagym.tasks.loaders import resolve_task

                return resolve_task(choice)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"unknown task {choice!r}: {e}") from None
        if choice is not None:
            raise ConfigError(f"options['task'] must be a task id or a Task, not {type(choice).__name__}")
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _new_workspace_dir(self, task_id: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", task_id)[:80]
        if self.config.workspace_root is None:
            return Path(tempfile.mkdtemp(prefix=f"cudagym-{safe}-"))
        d = Path(self.config.workspace_root) / f"{safe}-{uuid.uuid4().hex[:8]}"
        d.mkdir(parents=True)
        return d

    def _cleanup_workspace(self) -> None:
        if self._workspace_dir is not None and not self.config.keep_workspaces:
            shutil.rmtree(self._workspace_dir, ignore_errors=True)
        self._workspace_dir = None


def _water_fill(sizes: list[int], total: int) -> list[int]:
    """Shares of `total` for items of `sizes`: small items whole, the rest an equal share each."""
    shares = [0] * len(sizes)
    left = max(total, 0)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for k, i in enumerate(order):
        even = left // (len(order) - k)
        shares[i] = min(sizes[i], even)
        left -= shares[i]
    return shares


def _trim_to_tokens(text: str, max_tokens: int, count: Any) -> str:
    """`text` trimmed (error lines, head and tail kept) until it counts at most `max_tokens`."""
    if max_tokens <= 0:
        return ""
    n = count(text)
    chars = int(len(text) * max_tokens / max(n, 1))
    for _ in range(10):
        out = trim_output(text, max(chars, 1))
        if len(out) > chars:  # trim_output keeps whole short lines and its markers: cut what is over
            out = out[:chars]
        if count(out) <= max_tokens:
            return out
        chars = int(chars * 0.8)
    return ""


def _as_tasks(tasks: list[Task] | Task | str | None) -> list[Task]:
    if isinstance(tasks, Task):
        return [tasks]
    if tasks is None or isinstance(tasks, str):
        from cudagym.tasks.loaders import bundled_tasks, load_tasks

        return bundled_tasks() if tasks is None else load_tasks(tasks)
    return list(tasks)
