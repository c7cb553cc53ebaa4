"""What a chat template adds around a tool observation, for the trainers' token accounting.

Both trainer paths (`trl`, `verl_loop`) append each observation to the episode's tokens as the
chat template renders it: a user message holding ``<tool_response>`` ... ``</tool_response>``,
then the next generation prompt. The env counts an observation with the tokenizer alone, plus
``EnvConfig.message_overhead_tokens``; `observation_overhead` measures that overhead for a
tokenizer, so the env's budget and the tokens really appended agree.
"""

from __future__ import annotations

from typing import Any

from cudagym.agent.prompt import tool_response
from cudagym.errors import ConfigError

OBSERVATION_MARGIN_TOKENS = 2  # added to the measured overhead: tokens that merge differently at a boundary


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
           tools: list[dict[str, Any]] | None = None) -> list[int]:
    """`messages` through the tokenizer's chat template, as token ids."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=add_generation_prompt, return_dict=False)
    return list(ids)


def observation_ids(tokenizer: Any, obs: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The tokens the chat template puts after an assistant turn (ended by EOS) for the user
    message carrying `obs`, up to and including the next generation prompt."""
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    prefix = render(tokenizer, before, add_generation_prompt=False, tools=tools)
    eos = tokenizer.eos_token_id
    if eos in prefix:  # templates that end a turn with EOS plus a newline: the newline is the suffix's
        prefix = prefix[: len(prefix) - prefix[::-1].index(eos)]
    full = render(tokenizer, before + [{"role": "user", "content": tool_response(obs)}], add_generation_prompt=True,
                  tools=tools)
    if full[: len(prefix)] != prefix:
        raise ConfigError("the tokenizer's chat template does not render a conversation as a prefix of its "
                          "continuation; multi-turn training needs one that does")
    return full[len(prefix):]


def observation_overhead(tokenizer: Any, count: Any, tools: list[dict[str, Any]] | None = None) -> int:
    """The tokens the template adds to an observation beyond `count(obs)` (the env's counter),
    plus one: the EOS that closes a turn the budget cut."""
    probe = "x"
    return len(observation_ids(tokenizer, probe, tools)) - count(probe) + 1
