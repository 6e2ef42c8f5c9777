"""`response_format` of a chat request: plain text, any JSON object, or JSON following a schema,
and the `llm` guide each asks for (guided_decoding_guide_type, guided_decoding_guide)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from splitfuse.openai_api.json_schemas import schema_text
from splitfuse.openai_api.strict import Strict, bounded_schema

# OpenAI's rule for the names of schemas and functions.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class JsonSchemaSpec(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """None: any JSON object, as json_object."""
    strict: bool | None = None
    """Accepted either way: the output always follows the schema (xgrammar's subset of it)."""

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return bounded_schema(v, "the schema")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


def format_guide(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> tuple[str, str] | None:
    """(guide type, guide) for `llm`, or None for free text."""
    if isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema_ is not None:
        return "json_schema", schema_text(fmt.json_schema.schema_)
    if isinstance(fmt, (JsonObjectFormat, JsonSchemaFormat)):
        return "json", ""
    return None
