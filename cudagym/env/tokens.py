"""Counting tokens: with a real tokenizer when one is given, else an estimate of 4 chars a token."""

from __future__ import annotations

import math
import os
from typing import Any, Protocol


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class CharEstimate:
    """ceil(len / chars_per_token): cheap and tokenizer-free."""

    def __init__(self, chars_per_token: float = 4.0) -> None:
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token) if text else 0


class TokenizerCounter:
    """Exact counts from a real tokenizer: a `tokenizers.Tokenizer` or a `transformers` tokenizer
    (the one the trainer uses, so that the env's budget and the trainer's sequence lengths agree).

    Text is counted without special tokens; the tokens a chat template adds around a message are
    the caller's to declare (`EnvConfig.message_overhead_tokens`).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TokenizerCounter:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def count(self, text: str) -> int:
        if not text:
            return 0
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return len(enc.ids) if hasattr(enc, "ids") else len(enc)
