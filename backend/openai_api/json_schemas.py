"""JSON schemas clients send (response_format, tools' parameters): bounded here, before the `llm`
model compiles them into grammars, and moved under another schema without breaking their `$ref`s.

xgrammar compiles a guide on a request's way into the engine; the bounds keep what one request
can ask of that compiler (and of the grammar cache) small: its JSON text and how deeply it nests.
"""

from __future__ import annotations

import json
from typing import Any

from splitfuse.structured.guide import MAX_GUIDE_LENGTH

# Deeper than any schema written by hand; xgrammar's converter recurses per level.
MAX_SCHEMA_DEPTH = 32
# Keywords whose values are data, not schemas: a "$ref" inside one is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map any names (a property may be called "const") to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def schema_text(schema: dict[str, Any]) -> str:
    """The schema as the JSON text sent to `llm`."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def depth(value: Any) -> int:
    """How many objects and arrays nest in `value` (iteratively: a deep body must not recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


def check_schema(schema: dict[str, Any], what: str) -> dict[str, Any]:
    """`schema` when it is within the bounds; ValueError naming `what` otherwise."""
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(schema_text(schema)) > MAX_GUIDE_LENGTH:
        raise ValueError(f"{what} is longer than {MAX_GUIDE_LENGTH} characters as JSON")
    return schema


def rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of `schema` to be placed at JSON pointer `pointer` of another document: its local
    references ("#", "#/$defs/x") are rewritten to point under it ("#/$defs/t0/$defs/x")."""
    if isinstance(schema, list):
        return [rebase_refs(v, pointer) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebase_refs(sub, pointer) for name, sub in value.items()}
        else:
            out[key] = rebase_refs(value, pointer)
    return out
