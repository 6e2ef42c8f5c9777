"""Refusing a text that cannot fit the context before tokenizing it.

No token of a tokenizer covers more characters than its longest vocabulary entry (a byte-level
BPE entry spells one character per byte; a SentencePiece piece's text is at least as long as what
it decodes to), so a text of more than `context_tokens` x that many characters needs more tokens
than the context holds. Checking the length first costs nothing, where tokenizing a 5 MB text
held a tokenizer (and whatever shares its thread) for seconds to learn the same."""

from __future__ import annotations

from typing import Any


class PromptLimit:
    def __init__(self, tokenizer: Any, context_tokens: int) -> None:
        self.context_tokens = context_tokens
        self.longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = context_tokens * max(1, self.longest_token)

    def check(self, text: str, what: str = "the prompt") -> None:
        """Raise ValueError when `text` cannot fit `context_tokens` tokens."""
        if len(text) > self.max_chars:
            raise ValueError(f"{what} has {len(text)} characters, more than the context of {self.context_tokens} "
                             f"tokens can hold with this tokenizer (at most {self.max_chars}); it was not tokenized")
