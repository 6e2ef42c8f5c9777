"""The base of every request-body model: strict JSON types and no unknown fields."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from splitfuse.openai_api.json_schemas import check_schema


class Strict(BaseModel):
    # strict: a JSON value of another type is refused, never coerced ("true" is not a boolean),
    # so what is accepted is what the OpenAPI document says.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


def bounded_schema(schema: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A client's JSON schema checked against the size and keyword bounds (None passes)."""
    return None if schema is None else check_schema(schema, what)
