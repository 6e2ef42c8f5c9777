"""What every way in checks of a prompt before any model work: `InputError`, the prompt limit,
chat messages and their rendering through the tokenizer's chat template. Used by the Triton
models (request parsing, preprocessing), the OpenAI front and the engine's validation.

No token of a tokenizer covers more characters than its longest vocabulary entry (a byte-level
BPE entry spells one character per byte; a SentencePiece piece's text is at least as long as what
it decodes to), so a text of more than `context_tokens` x that many characters needs more tokens
than the context holds. Checking the length first costs nothing, where tokenizing a 5 MB text
held a tokenizer (and whatever shares its thread) for seconds to learn the same."""

from __future__ import annotations

import json
from typing import Any


class InputError(ValueError):
    """A request the client must fix; its message goes back in the error response."""


class PromptLimit:
    def __init__(self, tokenizer: Any, context_tokens: int) -> None:
        self.context_tokens = context_tokens
        self.longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = context_tokens * max(1, self.longest_token)

    def check(self, text: str, what: str = "the prompt") -> None:
        """Raise InputError when `text` cannot fit `context_tokens` tokens."""
        if len(text) > self.max_chars:
            raise InputError(f"{what} has {len(text)} characters, more than the context of {self.context_tokens} "
                             f"tokens can hold with this tokenizer (at most {self.max_chars}); it was not tokenized")


def parse_messages(text: str, field: str) -> list[dict[str, Any]]:
    """A JSON list of {"role", "content"} messages, or plain text as one user message."""
    if not text.lstrip().startswith("["):
        return [{"role": "user", "content": text}]
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{field} looks like a JSON message list but does not parse: {e}") from None
    if not messages or not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError(f'chat {field} must be a non-empty list of {{"role": str, "content": str}}')
    return messages


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """The prompt text the tokenizer's chat template makes of `messages`, ready for the
    assistant's turn. InputError when there is no template or it refuses the messages."""
    if not has_chat_template(tokenizer):
        raise InputError("this tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. roles must alternate)
        raise InputError(f"the chat template rejected the messages: {e}") from None
