"""Requests -> prompt token ids, and token ids -> the strings OpenAI's log-probs show.

Tokenizing here, in the API process, keeps the engine's thread free of it and gives exact
`usage.prompt_tokens`; the ids go to the `llm` model as `input_ids`. Plain prompts get the
tokenizer's special tokens (BOS), as the `preprocessing` model adds them; chat prompts are
rendered by the chat template, which writes its own.
"""

from __future__ import annotations

from typing import Any

from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from splitfuse.prompt_limit import PromptLimit


class Prompts:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.limit = PromptLimit(tokenizer, max_model_len)

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            self.limit.check(text, param)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def completion(self, req: CompletionRequest) -> tuple[list[int], str]:
        """(prompt ids, prompt text for `echo`)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return self._tokenize(prompt, "prompt", add_special_tokens=True), prompt
        vocab = len(self.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt), self.tokenizer.decode(prompt, skip_special_tokens=True)

    def chat(self, req: ChatCompletionRequest) -> list[int]:
        if not self.has_chat_template:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions with a plain "
                                "prompt", param="messages", code="no_chat_template")
        # Each message alone, before the template runs over them all.
        for m in req.messages:
            try:
                self.limit.check(m.text(), "a message")
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
        messages = []
        for m in req.messages:
            extra = {k: v for k, v in (m.model_extra or {}).items() if isinstance(v, str)}
            messages.append({**extra, "role": m.role, "content": m.text()})
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (e.g. roles must alternate)
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return self._tokenize(text, "messages", add_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (a piece of a multi-byte character shows as U+FFFD)."""
        return [self.tokenizer.decode([i]) for i in ids]
