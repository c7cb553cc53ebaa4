"""Turning an action into tool calls.

An action is either text (an LLM turn: free reasoning plus tool calls in the Hermes form
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or a bare JSON call, possibly in a
```json fence) or structured: a `ToolCall`, a dict ``{"name", "arguments"}`` (also the OpenAI
``{"function": {"name", "arguments": "<json>"}}`` form), or a list of those. Parsing never
raises: a malformed action yields `ParsedAction.error` with a message for the agent.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, Field

from cudagym.env.tools import ToolCall

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)

FORMAT_HELP = (
    'Call a tool as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call> '
    "(one block per call; arguments is a JSON object)."
)


class ParsedAction(BaseModel):
    calls: list[ToolCall] = Field(default_factory=list)
    error: str | None = None  # why (some of) the action could not be understood
    text: str = ""  # the turn's text, for token accounting


def parse_action(action: Any) -> ParsedAction:
    if isinstance(action, str):
        return parse_text(action)
    try:
        items = action if isinstance(action, (list, tuple)) else [action]
        calls = [_coerce_call(x) for x in items]
    except _BadCallError as e:
        return ParsedAction(error=str(e))
    text = json.dumps([c.model_dump() for c in calls], default=str)
    if not calls:
        return ParsedAction(error="the action holds no tool call. " + FORMAT_HELP, text=text)
    return ParsedAction(calls=calls, text=text)


def parse_text(text: str) -> ParsedAction:
    """Tool calls of an LLM turn (Hermes blocks, else the whole text as one bare JSON call)."""
    body = _THINK.sub("", text)
    blocks = _TOOL_CALL.findall(body)
    calls: list[ToolCall] = []
    errors: list[str] = []
    if blocks:
        for i, block in enumerate(blocks, 1):
            try:
                value = _loads(_unfence(block.strip()))
                for item in value if isinstance(value, list) else [value]:
                    calls.append(_coerce_call(item))
            except _BadCallError as e:
                errors.append(f"tool call #{i}: {e}")
    else:
        stripped = _unfence(body.strip())
        if stripped.startswith(("{", "[")):
            try:
                value = _loads(stripped)
                for item in value if isinstance(value, list) else [value]:
                    calls.append(_coerce_call(item))
            except _BadCallError as e:
                errors.append(str(e))
        else:
            errors.append("no tool call found in your message. " + FORMAT_HELP)
    if errors and not calls:
        msg = "; ".join(errors)
        return ParsedAction(error=msg if FORMAT_HELP in msg else f"{msg}. {FORMAT_HELP}", text=text)
    return ParsedAction(calls=calls, error="; ".join(errors) or None, text=text)


class _BadCallError(ValueError):
    pass


def _unfence(s: str) -> str:
    m = _FENCE.match(s)
    return m.group(1).strip() if m else s


def _loads(s: str) -> Any:
    try:
        return json.loads(s, strict=False)  # strict=False: raw newlines inside strings are common
    except json.JSONDecodeError as e:
        raise _BadCallError(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def _coerce_call(item: Any) -> ToolCall:
    if isinstance(item, ToolCall):
        return item
    if hasattr(item, "model_dump"):
        item = item.model_dump()
    if not isinstance(item, dict):
        raise _BadCallError(f"a tool call must be a JSON object with 'name' and 'arguments', not {type(item).__name__}")
    call_id = item.get("id")
    if isinstance(item.get("function"), dict):  # OpenAI native form
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise _BadCallError("a tool call needs a string 'name'")
    args = item.get("arguments", item.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise _BadCallError(f"the 'arguments' of {name} must be a JSON object, not {type(args).__name__}")
    return ToolCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) else None)
