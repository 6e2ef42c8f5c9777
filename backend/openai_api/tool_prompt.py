"""Tools and earlier tool calls in a chat prompt.

The chat template renders them when it knows how (transformers passes `tools=` and messages'
`tool_calls` to it). Many templates do neither (the test models' and SmolLM2's): then the tools
go into the system message, with the `<tool_call>` format the output is parsed in
(tool_parser.py), and earlier calls are written into their message's content in that format.
Whether a template renders them is found once per template by rendering a probe.
"""

from __future__ import annotations

import json
from typing import Any

from splitfuse.openai_api.tool_parser import CLOSE, OPEN
from splitfuse.openai_api.tools import Tool

_PROBE = "splitfuse_probe_fn"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_probe", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}]


def call_block(name: str, arguments: Any) -> str:
    """One call as the model is told to write it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def tools_instructions(tools: list[Tool]) -> str:
    """The system text that shows the tools to a template that does not render them."""
    lines = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("You can use tools. These functions are available, one JSON description per line:\n"
            f"{lines}\n\n"
            "To call one, answer with a block like this for each call (the arguments as a JSON object "
            "following the function's parameters schema):\n"
            f"{call_block('<function name>', {'<argument>': '<value>'})}\n"
            "A function's result comes back in a message from the tool.")


def with_instructions(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` added to the conversation's system message (prepended as one when there is none):
    templates often take a single system message, and only first."""
    if messages and messages[0]["role"] in ("system", "developer") and isinstance(messages[0]["content"], str):
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class TemplateSupport:
    """Whether a tokenizer's chat template renders `tools` and messages' `tool_calls`."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], bool] = {}

    def _renders(self, tokenizer: Any, what: str) -> bool:
        key = (str(tokenizer.chat_template), what)
        if key not in self._known:
            try:
                if what == "tools":
                    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[_PROBE_TOOL],
                                                         add_generation_prompt=True, tokenize=False)
                else:
                    text = tokenizer.apply_chat_template(_PROBE_CALL, add_generation_prompt=True, tokenize=False)
                self._known[key] = _PROBE in text
            except Exception:  # a template with rules of its own: treat it as not rendering them
                self._known[key] = False
        return self._known[key]

    def tools(self, tokenizer: Any) -> bool:
        return self._renders(tokenizer, "tools")

    def tool_calls(self, tokenizer: Any) -> bool:
        return self._renders(tokenizer, "tool_calls")
