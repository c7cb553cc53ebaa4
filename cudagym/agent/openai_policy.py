"""A policy backed by an OpenAI-compatible chat-completions server (vLLM, SGLang, hosted APIs).

Two tool-calling styles: ``native`` sends the tool schemas in the request and reads
``message.tool_calls``; ``hermes`` puts the schemas in the system prompt (see
`cudagym.agent.prompt.system_prompt(hermes=True)`) and lets the env parse ``<tool_call>``
blocks from the text, for servers started without a tool-call parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, Field

from cudagym.agent.policy import AssistantTurn, Policy, PolicyError, TurnContext
from cudagym.agent.prompt import tool_response
from cudagym.env.tools import ToolCall


class OpenAIPolicyConfig(BaseModel):
    """Connection and sampling settings; unset fields come from the environment."""

    base_url: str | None = Field(default=None, description="OPENAI_BASE_URL if unset")
    api_key: str | None = Field(default=None, description="OPENAI_API_KEY if unset ('EMPTY' for local servers)")
    model: str | None = Field(default=None, description="CUDAGYM_MODEL if unset")
    tool_mode: Literal["native", "hermes"] = "native"
    temperature: float = 0.7
    top_p: float | None = None
    max_tokens: int | None = 4096  # per completion
    timeout_s: float = 300.0
    max_retries: int = 3  # transport-level retries (connection errors, 408/409/429/5xx), SDK backoff
    extra_body: dict[str, Any] = Field(default_factory=dict)  # server-specific sampling options

    def resolved(self) -> OpenAIPolicyConfig:
        model = self.model or os.environ.get("CUDAGYM_MODEL")
        if not model:
            raise PolicyError("no model name: pass --model or set CUDAGYM_MODEL")
        return self.model_copy(update={
            "base_url": self.base_url or os.environ.get("OPENAI_BASE_URL"),
            "api_key": self.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            "model": model,
        })


class OpenAIChatPolicy(Policy):
    name = "openai"

    def __init__(self, config: OpenAIPolicyConfig | None = None, **overrides: Any) -> None:
        self.config = (config or OpenAIPolicyConfig()).model_copy(update=overrides).resolved()
        self._clients: dict[int, Any] = {}  # one client per event loop: httpx pools are loop-bound

    @property
    def hermes(self) -> bool:
        return self.config.tool_mode == "hermes"

    def _client(self) -> Any:
        from openai import AsyncOpenAI

        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            self._clients[key] = AsyncOpenAI(base_url=self.config.base_url, api_key=self.config.api_key,
                                             timeout=self.config.timeout_s, max_retries=self.config.max_retries)
        return self._clients[key]

    async def aact(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: TurnContext
    ) -> AssistantTurn:
        import openai

        cfg = self.config
        kwargs: dict[str, Any] = {
            "model": cfg.model,
            "messages": _for_wire(messages, self.hermes),
            "temperature": cfg.temperature,
        }
        if cfg.top_p is not None:
            kwargs["top_p"] = cfg.top_p
        if cfg.max_tokens is not None:
            kwargs["max_tokens"] = cfg.max_tokens
        if not self.hermes and tools:
            kwargs["tools"] = tools
            kwargs["tool_choice"] = "auto"
        if cfg.extra_body:
            kwargs["extra_body"] = cfg.extra_body
        try:
            resp = await self._client().chat.completions.create(**kwargs)
        except openai.APIStatusError as e:
            raise PolicyError(f"chat server answered HTTP {e.status_code}: {str(e)[:300]}") from None
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise PolicyError(f"chat server unreachable after {cfg.max_retries} retries: {e}") from None
        if not resp.choices:
            raise PolicyError("chat server returned no choices")
        msg = resp.choices[0].message
        calls = []
        for i, tc in enumerate(msg.tool_calls or []):
            fn = getattr(tc, "function", None)
            if fn is None:
                continue
            try:
                args = json.loads(fn.arguments) if fn.arguments else {}
            except json.JSONDecodeError:
                args = {"_unparsed_arguments": fn.arguments}  # the env reports it as a bad argument
            if not isinstance(args, dict):
                args = {"_unparsed_arguments": fn.arguments}
            calls.append(ToolCall(name=fn.name, arguments=args, id=tc.id or f"call_{context.turn}_{i}"))
        usage = {}
        if resp.usage is not None:
            usage = {
                "prompt_tokens": resp.usage.prompt_tokens or 0,
                "completion_tokens": resp.usage.completion_tokens or 0,
            }
        content = msg.content or ""
        reasoning = getattr(msg, "reasoning_content", None)  # vLLM/SGLang reasoning parsers
        if reasoning and not calls and "<tool_call>" not in content and "<tool_call>" in reasoning:
            content = reasoning + "\n" + content
        return AssistantTurn(content=content, tool_calls=calls, usage=usage)

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            with contextlib.suppress(Exception):  # closing a client of a finished loop
                await c.close()


def _for_wire(messages: list[dict[str, Any]], hermes: bool) -> list[dict[str, Any]]:
    """In Hermes mode servers must not see native tool fields: fold them into text."""
    if not hermes:
        return messages
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": tool_response(m.get("content", ""))})
        elif m.get("tool_calls"):
            blocks = "".join(
                "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": json.loads(c["function"]["arguments"] or "{}")})
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m.get("content") or "") + blocks})
        else:
            out.append(m)
    return out
