"""Counting tokens: with a real tokenizer when one is given, else an estimate of 4 chars a token."""

from __future__ import annotations

import math
import os
from typing import Any, Protocol


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class CharEstimate:
    """ceil(len / chars_per_token): cheap and tokenizer-free."""

    def __init__(self, chars_per_token: float = 4.0):
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token) if text else 0


class TokenizerCounter:
    """Exact counts from a `tokenizers.Tokenizer` (the Hugging Face `tokenizers` library)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TokenizerCounter:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
