"""The policy interface: a conversation and the tool schemas in, one assistant turn out.

Messages use the OpenAI chat format (``{"role", "content"}``, assistant ``tool_calls``, ``tool``
messages with ``tool_call_id``). A policy answers with an `AssistantTurn`: free text (which may
hold Hermes ``<tool_call>`` blocks) and/or native tool calls. `TurnContext` says which episode
and turn this is, so a policy object can serve many concurrent episodes without state.

Implement `aact` (async); `act` is its sync form. Failures to reach a model raise `PolicyError`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pydantic import BaseModel, Field

from cudagym.env.tools import ToolCall
from cudagym.errors import CudagymError
from cudagym.sandbox.bridge import run_sync


class PolicyError(CudagymError):
    """The policy could not produce a turn (server unreachable after retries, bad reply)."""


class TurnContext(BaseModel):
    episode_id: str
    task_id: str
    target: str  # "cuda" | "cpu"
    turn: int  # 0-based index of the assistant turn in this episode


class AssistantTurn(BaseModel):
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)  # native calls (each with an id)
    usage: dict[str, int] = Field(default_factory=dict)  # prompt_tokens, completion_tokens, ...

    def action(self) -> Any:
        """The env action for this turn: the native calls if any, else the text."""
        return list(self.tool_calls) if self.tool_calls else self.content

    def message(self) -> dict[str, Any]:
        """This turn as an OpenAI-format assistant message."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            import json

            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in self.tool_calls
            ]
        return msg


class Policy:
    """Base class: subclasses implement `aact`."""

    name = "policy"

    async def aact(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: TurnContext
    ) -> AssistantTurn:
        raise NotImplementedError

    def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: TurnContext) -> AssistantTurn:
        return run_sync(self.aact(messages, tools, context), async_form="await policy.aact(...)")

    async def aclose(self) -> None:
        """Release connections (optional)."""


class CallablePolicy(Policy):
    """A policy from a Python function ``fn(messages, tools, context)`` (sync or async).

    It may return an `AssistantTurn`, a string (text turn), a dict ``{"name", "arguments"}`` or a
    list of such dicts (structured calls).
    """

    def __init__(self, fn: Any, name: str | None = None) -> None:
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", "callable"))

    @classmethod
    def from_spec(cls, spec: str) -> CallablePolicy:
        """`module:function` (the module must be importable)."""
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise PolicyError(f"policy {spec!r}: expected 'module:function'")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise PolicyError(f"policy {spec!r}: {e}") from None
        if isinstance(fn, Policy):
            return fn  # type: ignore[return-value]
        if isinstance(fn, type) and issubclass(fn, Policy):
            return fn()  # type: ignore[return-value]
        return cls(fn, name=spec)

    async def aact(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: TurnContext
    ) -> AssistantTurn:
        out = self.fn(messages, tools, context)
        if inspect.isawaitable(out):
            out = await out
        return as_turn(out, context)


def as_turn(out: Any, context: TurnContext) -> AssistantTurn:
    if isinstance(out, AssistantTurn):
        return out
    if isinstance(out, str):
        return AssistantTurn(content=out)
    items = out if isinstance(out, list) else [out]
    calls = []
    for i, item in enumerate(items):
        call = item if isinstance(item, ToolCall) else ToolCall.model_validate(item)
        if call.id is None:
            call = call.model_copy(update={"id": f"call_{context.turn}_{i}"})
        calls.append(call)
    return AssistantTurn(tool_calls=calls)
