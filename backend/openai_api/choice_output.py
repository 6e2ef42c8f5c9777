"""One choice of an answer, built from its `llm` responses: the stream's per-step choice objects
and, from the same deltas, the whole choice. Feeding every step to `step` and then calling
`whole` gives what a non-streaming client gets, so the two forms cannot disagree.

Chat choices carry content, tool calls (tool_choice auto: parsed from `<tool_call>` blocks;
forced: the whole output is the call) and log-probs; completion choices carry text (after an
echoed prompt) and legacy log-probs.
"""

from __future__ import annotations

from typing import Literal

from splitfuse.openai_api.logprobs import ChatLogprobs, CompletionLogprobs, TokenLogprobs, TokenStrings
from splitfuse.openai_api.tool_parser import ParsedCall, ToolCallParser, parse_call
from splitfuse.openai_api.tools import new_call_id
from splitfuse.openai_api.triton_llm import Step

ToolMode = Literal["none", "auto", "forced"]


class _Tokens:
    """A choice's output token count over all its steps."""

    def __init__(self) -> None:
        self.num_output = 0

    def add(self, step: Step) -> TokenLogprobs:
        """This step's tokens and log-probs (the running count updated)."""
        self.num_output = step.num_output_tokens if step.num_output_tokens is not None else (
            self.num_output + len(step.token_ids))
        return TokenLogprobs(step.token_ids, list(step.logprobs or []), step.top_ids, step.top_logprobs)


class ChatChoiceOutput:
    def __init__(self, index: int, tool_mode: ToolMode, logprobs: bool, strings: TokenStrings) -> None:
        self.index = index
        self.tool_mode = tool_mode
        self.logprobs = logprobs
        self.strings = strings
        self.tokens = _Tokens()
        self.lp_log = ChatLogprobs()
        self._parser = ToolCallParser() if tool_mode == "auto" else None
        self._forced_text = ""
        self._content: list[str] = []
        self._calls: list[dict] = []
        self.finish_reason: str | None = None

    def first(self) -> dict:
        """The stream's opening delta. With tools the content starts as null: a choice that only
        calls has none."""
        delta = {"role": "assistant"} if self.tool_mode != "none" else {"role": "assistant", "content": ""}
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _pieces(self, step: Step) -> list[str | ParsedCall]:
        if self._parser is not None:
            return self._parser.feed(step.text) + (self._parser.finish() if step.final else [])
        if self.tool_mode == "forced":
            self._forced_text += step.text
            if not step.final:
                return []
            call = parse_call(self._forced_text)  # None: cut short (length) before the call was whole
            return [call if call is not None else self._forced_text]
        return [step.text] if step.text else []

    def step(self, step: Step) -> dict | None:
        """The stream's choice object for this step, or None when there is nothing to send."""
        lp = self.tokens.add(step)
        delta: dict = {}
        text = ""
        calls = []
        for piece in self._pieces(step):
            if isinstance(piece, ParsedCall):
                call = {"index": len(self._calls), "id": new_call_id(), "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments}}
                self._calls.append(call)
                calls.append(call)
            elif piece:
                text += piece
        if text:
            self._content.append(text)
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        if step.final:
            reason = step.finish_reason
            self.finish_reason = "tool_calls" if self._calls and reason == "stop" else reason
        logprobs = self.lp_log.add(lp, self.strings) if self.logprobs and lp.ids else None
        if not delta and logprobs is None and not step.final:
            return None
        return {"index": self.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": self.finish_reason if step.final else None}

    def whole(self) -> dict:
        # With tools, no content is null, as a stream that never sent any (see `first`).
        content = "".join(self._content) or (None if self.tool_mode != "none" else "")
        message: dict = {"role": "assistant", "content": content}
        if self._calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self._calls]
        return {"index": self.index, "message": message,
                "logprobs": self.lp_log.whole() if self.logprobs else None,
                "finish_reason": self.finish_reason}


class CompletionChoiceOutput:
    def __init__(self, index: int, logprobs: int | None, echo: str, strings: TokenStrings) -> None:
        self.index = index
        self.logprobs = logprobs
        self.echo = echo
        self.strings = strings
        self.tokens = _Tokens()
        self.lp_log = CompletionLogprobs(want_top=bool(logprobs))
        self._text: list[str] = []
        self._offset = len(echo)
        self.finish_reason: str | None = None

    def first(self) -> dict | None:
        """The stream's opening choice object: the echoed prompt, when there is one."""
        if not self.echo:
            return None
        return {"index": self.index, "text": self.echo, "logprobs": None, "finish_reason": None}


    def step(self, step: Step) -> dict | None:
        lp = self.tokens.add(step)
        if step.final:
            self.finish_reason = step.finish_reason
        if not (step.text or step.token_ids or step.final):
            return None
        logprobs = None if self.logprobs is None else self.lp_log.add(lp, self.strings, self._offset)
        self._text.append(step.text)
        self._offset += len(step.text)
        return {"index": self.index, "text": step.text, "logprobs": logprobs,
                "finish_reason": self.finish_reason if step.final else None}

    def whole(self) -> dict:
        return {"index": self.index, "text": self.echo + "".join(self._text),
                "logprobs": None if self.logprobs is None else self.lp_log.whole(),
                "finish_reason": self.finish_reason}
