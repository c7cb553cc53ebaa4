"""Keeping a conversation under a token budget.

`ContextBudget.fit` returns a copy of the messages that fits `max_tokens`, shrinking in this
order until it fits: (1) tool outputs of older turns are elided, oldest first; (2) long
arguments of older tool calls (file contents written) and long older assistant texts are elided;
(3) whole older turns (an assistant message with its tool responses) are dropped, oldest first.
The system prompt, the task prompt (first user message) and the last `keep_recent` messages
are never touched. Tokens are counted with a real tokenizer when given, else chars/4.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from cudagym.env.tokens import CharEstimate, TokenCounter

MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of a chat template, roughly
_ELIDED = "[{what} elided to save context: {n} tokens]"


class ContextBudget:
    def __init__(self, max_tokens: int, counter: TokenCounter | None = None, keep_recent: int = 4,
                 min_elide_tokens: int = 64) -> None:
        self.max_tokens = max_tokens
        self.counter = counter or CharEstimate()
        self.keep_recent = keep_recent
        self.min_elide_tokens = min_elide_tokens

    def message_tokens(self, msg: dict[str, Any]) -> int:
        n = MESSAGE_OVERHEAD_TOKENS + self.counter.count(msg.get("content") or "")
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {})
            n += self.counter.count(fn.get("name", "")) + self.counter.count(fn.get("arguments", ""))
        return n

    def total(self, messages: list[dict[str, Any]]) -> int:
        return sum(self.message_tokens(m) for m in messages)

    def fit(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        msgs = copy.deepcopy(messages)
        sizes = [self.message_tokens(m) for m in msgs]
        total = sum(sizes)
        if total <= self.max_tokens:
            return msgs
        first_user = next((i for i, m in enumerate(msgs) if m.get("role") == "user"), 0)
        protected_head = first_user + 1
        protected_tail = max(protected_head, len(msgs) - self.keep_recent)
        middle = range(protected_head, protected_tail)

        def shrink(i: int, new_msg: dict[str, Any]) -> None:
            nonlocal total
            new_size = self.message_tokens(new_msg)
            total += new_size - sizes[i]
            sizes[i] = new_size
            msgs[i] = new_msg

        # 1. tool outputs (role tool, or user messages that carry tool responses), oldest first
        for i in middle:
            if total <= self.max_tokens:
                return msgs
            m = msgs[i]
            if _is_tool_output(m) and sizes[i] > self.min_elide_tokens:
                shrink(i, {**m, "content": _ELIDED.format(what="tool output", n=sizes[i])})
        # 2. long call arguments and long assistant texts of older turns
        for i in middle:
            if total <= self.max_tokens:
                return msgs
            m = msgs[i]
            if m.get("role") != "assistant" or sizes[i] <= self.min_elide_tokens:
                continue
            new = dict(m)
            if new.get("tool_calls"):
                calls = []
                for c in new["tool_calls"]:
                    fn = dict(c.get("function", {}))
                    args = fn.get("arguments", "")
                    if self.counter.count(args) > self.min_elide_tokens:
                        fn["arguments"] = json.dumps(_elide_args(args, self))
                    calls.append({**c, "function": fn})
                new["tool_calls"] = calls
            content = new.get("content") or ""
            if self.counter.count(content) > self.min_elide_tokens:
                new["content"] = _ELIDED.format(what="earlier message", n=self.counter.count(content))
            shrink(i, new)
        # 3. drop whole older turns, oldest first (an assistant message and the outputs after it)
        drop: set[int] = set()
        i = protected_head
        while total > self.max_tokens and i < protected_tail:
            j = i + 1
            while j < protected_tail and msgs[j].get("role") != "assistant":
                j += 1
            for k in range(i, j):
                drop.add(k)
                total -= sizes[k]
            i = j
        kept = [m for k, m in enumerate(msgs) if k not in drop]
        if drop:
            kept.insert(
                protected_head,
                {"role": "user", "content": f"[{len(drop)} earlier messages were removed to save context]"},
            )
        return kept


def _is_tool_output(m: dict[str, Any]) -> bool:
    if m.get("role") == "tool":
        return True
    return m.get("role") == "user" and "<tool_response>" in (m.get("content") or "")


def _elide_args(args: str, budget: ContextBudget) -> dict[str, Any]:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return {"_elided": _ELIDED.format(what="arguments", n=budget.counter.count(args))}
    if not isinstance(value, dict):
        return {"_elided": _ELIDED.format(what="arguments", n=budget.counter.count(args))}
    out = {}
    for k, v in value.items():
        if isinstance(v, str) and budget.counter.count(v) > budget.min_elide_tokens:
            out[k] = _ELIDED.format(what=k, n=budget.counter.count(v))
        else:
            out[k] = v
    return out
