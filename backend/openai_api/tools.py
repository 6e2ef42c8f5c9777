"""A chat request's tools: their definitions, `tool_choice`, the calls of earlier assistant
messages, and the JSON schema that forces a call (tool_choice "required" or a named function).

A forced call is generated as one JSON object {"name": <a tool's name>, "arguments": <its
parameters>}, constrained by the schema `forced_call_schema` builds: the whole output is the call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitfuse.openai_api.json_schemas import rebase_refs
from splitfuse.openai_api.strict import Strict, bounded_schema
from splitfuse.openai_api.response_format import NAME_PATTERN

# OpenAI's limit on the number of tools of one request.
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
# Where each tool's parameters go in a forced call's schema (its $refs are rewritten to match).
_DEF_PREFIX = "splitfuse_tool_"
# A function declared without parameters takes none: its arguments are {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; None: the function takes no arguments."""
    strict: bool | None = None
    """Accepted either way: a forced call's arguments always follow the schema."""

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return bounded_schema(v, "the parameters schema")

    def arguments_schema(self) -> dict[str, Any]:
        return NO_PARAMETERS if self.parameters is None else self.parameters


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1)
    arguments: str
    """The arguments as a JSON text (OpenAI's form)."""


class ToolCall(BaseModel):
    """A call of an earlier assistant message in the conversation."""

    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_form(self) -> dict[str, Any]:
        """As chat templates take it (transformers' convention): arguments as an object when
        they are one, so a template's `tojson` does not quote them twice."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def tools_problem(tools: list[Tool] | None, choice: ToolChoice | None) -> tuple[str, str] | None:
    """(parameter, message) for names used twice or a choice no tool answers; None when fine."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        return "tools", "tools: function names must be unique"
    if choice == "required" and not names:
        return "tool_choice", "tool_choice 'required' needs tools"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return "tool_choice", f"tool_choice names a function no tool defines: {choice.function.name!r}"
    return None


def forced_call_schema(tools: list[Tool], only: str | None = None) -> dict[str, Any]:
    """The schema of one call: of the function named `only`, or of any of `tools`. Each tool's
    parameters sit in $defs (their own $refs rewritten), so a schema with references still works."""
    chosen = [t.function for t in tools if only is None or t.function.name == only]
    defs = {f"{_DEF_PREFIX}{i}": rebase_refs(f.arguments_schema(), f"/$defs/{_DEF_PREFIX}{i}")
            for i, f in enumerate(chosen)}
    calls = [{"type": "object",
              "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{_DEF_PREFIX}{i}"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, f in enumerate(chosen)]
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
