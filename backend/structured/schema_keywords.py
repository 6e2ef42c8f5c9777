"""JSON Schema keywords the grammar cannot enforce, refused before compiling.

xgrammar compiles a schema whatever keywords it holds, but some it does not enforce: sampled
freely under such a schema (random tokens among those the grammar allows), outputs broke
`not`, `uniqueItems`, `dependentRequired`, `dependentSchemas`, `contains`, `allOf` and `oneOf`
(its branches are taken as `anyOf`'s) in 10-100% of cases (xgrammar 0.2.8). A request that asks
for one would get output its schema rejects, so it is refused, naming the keyword and where it
is; the rest of JSON Schema as OpenAI's strict mode has it (types, properties, required,
additionalProperties, items, prefixItems, enum, const, anyOf, $ref/$defs, string length,
pattern and format, number bounds and multipleOf, array and object sizes) is enforced, but for
the `date` format's day, which may run to 31 in any month.
"""

from __future__ import annotations

from typing import Any

UNENFORCED = ("not", "if", "then", "else", "allOf", "oneOf", "uniqueItems", "dependentRequired",
              "dependentSchemas", "dependencies", "contains", "minContains", "maxContains",
              "unevaluatedItems", "additionalItems")
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_schema_keywords(schema: Any, where: str = "") -> None:
    """Raise ValueError naming the first keyword of UNENFORCED found in `schema` or any schema
    nested in it (its JSON pointer given)."""
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED:
        if keyword in schema:
            raise ValueError(f"guided_decoding_guide (json_schema): the keyword {keyword!r} at {where or '/'} is "
                             "not supported (structured outputs cannot enforce it)")
    for keyword in _SUBSCHEMA:
        check_schema_keywords(schema.get(keyword), f"{where}/{keyword}")
    for keyword in _SUBSCHEMA_LISTS:
        value = schema.get(keyword)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{where}/{keyword}/{i}")
    for keyword in _SUBSCHEMA_MAPS:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}/{keyword}/{name}")
