"""Requests -> prompt token ids, and token ids -> the strings OpenAI's log-probs show.

Tokenizing here, in the API process, keeps the engine's thread free of it and gives exact
`usage.prompt_tokens`; the ids go to the `llm` model as `input_ids`. Plain prompts get the
tokenizer's special tokens (BOS), as the `preprocessing` model adds them; chat prompts are
rendered by the chat template, which writes its own; tools and earlier tool calls are rendered
as tool_prompt.py says.
"""

from __future__ import annotations

from typing import Any

from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from splitfuse.openai_api.tool_prompt import TemplateSupport, call_block, tools_instructions, with_instructions
from splitfuse.inputs import InputError, PromptLimit, has_chat_template, render_chat


class Prompts:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.limit = PromptLimit(tokenizer, max_model_len)
        self.template = TemplateSupport()
        self._token_text: dict[int, str] = {}
        # What token_strings decodes each token after (see there).
        self._anchor: list[int] = tokenizer.encode("a", add_special_tokens=False)
        self._anchor_text: str = tokenizer.decode(self._anchor)

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            self.limit.check(text, param)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    @property
    def has_chat_template(self) -> bool:
        return has_chat_template(self.tokenizer)

    def completion(self, req: CompletionRequest) -> tuple[list[int], str]:
        """(prompt ids, prompt text for `echo`)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return self._tokenize(prompt, "prompt", add_special_tokens=True), prompt
        self._check_ids(prompt, "prompt")
        return list(prompt), self.tokenizer.decode(prompt, skip_special_tokens=True)

    def plain(self, prompt: str | list[int], param: str) -> list[int]:
        """A plain prompt's ids (text with the tokenizer's special tokens, or ids as given),
        refused with a 400 naming `param` when it does not fit max_model_len alone."""
        if isinstance(prompt, str):
            ids = self._tokenize(prompt, param, add_special_tokens=True)
        else:
            self._check_ids(prompt, param)
            ids = list(prompt)
        if len(ids) > self.limit.context_tokens:
            raise ApiError(400, f"{param} has {len(ids)} tokens, more than max_model_len {self.limit.context_tokens}",
                           param=param)
        return ids

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{param} token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)

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
        messages = self._messages(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if req.tools and not self.template.tools(self.tokenizer):
            messages, tools = with_instructions(messages, tools_instructions(req.tools)), None
        try:
            text = render_chat(self.tokenizer, messages, tools)
        except InputError as e:
            raise ApiError(400, str(e), param="messages") from None
        return self._tokenize(text, "messages", add_special_tokens=False)

    def _messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as the template takes them: string extras (name, ...) kept, earlier tool
        calls as `tool_calls` when the template renders them, else written into the content."""
        calls_as_data = self.template.tool_calls(self.tokenizer)
        messages = []
        for m in req.messages:
            extra = {k: v for k, v in (m.model_extra or {}).items() if isinstance(v, str)}
            message: dict[str, Any] = {**extra, "role": m.role, "content": m.text()}
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls and calls_as_data:
                message["tool_calls"] = [c.template_form() for c in m.tool_calls]
            elif m.tool_calls:
                blocks = [call_block(c.function.name, c.template_form()["function"]["arguments"])
                          for c in m.tool_calls]
                message["content"] = "\n".join(([message["content"]] if message["content"] else []) + blocks)
            messages.append(message)
        return messages

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (a piece of a multi-byte character shows as U+FFFD), with its
        leading space: decoded after a plain anchor token and cut after the anchor's text, since
        sentencepiece decoders strip the space that begins a decode ("\u2581world" -> " world")."""
        out = []
        for i in ids:
            text = self._token_text.get(i)
            if text is None:  # remembered: top log-probs decode up to 21 tokens per output token
                text = self._token_text[i] = self._token_text_of(i)
            out.append(text)
        return out

    def _token_text_of(self, token_id: int) -> str:
        text = self.tokenizer.decode(self._anchor + [token_id])
        if self._anchor and text.startswith(self._anchor_text):
            return text[len(self._anchor_text):]
        return self.tokenizer.decode([token_id])
