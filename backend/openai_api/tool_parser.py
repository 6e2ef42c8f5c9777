"""Tool calls in a model's free output (tool_choice "auto"): `<tool_call>` blocks, the Hermes /
Qwen convention, each holding {"name": ..., "arguments": {...}}; text outside the blocks is the
message's content.

`ToolCallParser` reads the output as it streams: text that may be the start of a block is held
back until it is known not to be one, a block is given out as a call once it closes. Reading a
whole output is the same parser fed once, so a streamed answer and a whole one agree. What it
decides, in order:
  - a block whose JSON is not a call ({"name": str, "arguments": object}; "parameters" is taken
    for "arguments", and none means {}) stays in the content as it was written;
  - whitespace between content and a block, or between blocks, is a separator, not content;
  - a block still open when the output ends is a call if its JSON is one, content otherwise;
  - without any call, the content is the output exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments as JSON text."""


def parse_call(text: str) -> ParsedCall | None:
    """The call a block's JSON (or a forced call's whole output) describes, or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin OPEN."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Output text in, (content pieces and calls) out, in order."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._held_space = ""  # trailing whitespace of the content: content or a separator
        self._after_block = False
        self.calls = 0

    def feed(self, text: str) -> list[str | ParsedCall]:
        out: list[str | ParsedCall] = []
        self._buf += text
        while True:
            if not self._inside:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_open(self._buf)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:at], out)
                self._buf, self._inside = self._buf[at + len(OPEN):], True
            else:
                at = self._buf.find(CLOSE)
                if at < 0:
                    return out
                body, self._buf, self._inside = self._buf[:at], self._buf[at + len(CLOSE):], False
                self._block(body, closed=True, out=out)

    def finish(self) -> list[str | ParsedCall]:
        """What is still held once the output ended."""
        out: list[str | ParsedCall] = []
        if self._inside:
            self._inside = False
            self._block(self._buf, closed=False, out=out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        if self._held_space and not self.calls:
            out.append(self._held_space)
        self._held_space = ""
        return out

    def _block(self, body: str, closed: bool, out: list[str | ParsedCall]) -> None:
        call = parse_call(body)
        if call is not None:
            self.calls += 1
            self._held_space, self._after_block = "", True  # separators around a call
            out.append(call)
        else:
            self._content(OPEN + body + (CLOSE if closed else ""), out)

    def _content(self, text: str, out: list[str | ParsedCall]) -> None:
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            out.append(body)
