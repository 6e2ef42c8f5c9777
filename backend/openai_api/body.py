"""Reading a request body within a bound, and decoding it as JSON the engine can take.

The bound is enforced while the body arrives (a chunked body declares no length), so a client
cannot make the front hold more than `limit` bytes of one request. Decoding refuses what
Python's json module accepts but no tokenizer or gRPC input can carry: NaN / Infinity, and
strings with unpaired UTF-16 surrogates ("\\ud800"), which made the tokenizer raise a TypeError
(a 500) before this check.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from splitfuse.openai_api.protocol import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# A character of a prompt takes at most 6 bytes of JSON: 4 as raw UTF-8, 6 as a \uXXXX escape
# (a character outside the BMP is one character of the limit, 12 escaped bytes or 4 raw).
JSON_BYTES_PER_CHAR = 6
# Room for everything around the prompt (the other fields, a chat's message envelopes).
BODY_ENVELOPE_BYTES = 64 * 1024

# Only a \u escape can produce a surrogate (strict UTF-8 decoding refuses encoded ones), so a
# body without one of these needs no further look.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def default_body_limit(max_prompt_chars: int) -> int:
    """4 MiB, or more when a prompt as long as the front accepts needs more."""
    return max(DEFAULT_MAX_BODY_BYTES, JSON_BYTES_PER_CHAR * max_prompt_chars + BODY_ENVELOPE_BYTES)


def too_large(limit: int) -> ApiError:
    # Connection: close: the rest of the body is never read, so the connection cannot serve
    # another request.
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         f"(--max-body-bytes)", code="request_too_large", headers={"Connection": "close"})


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as more than `limit` bytes are declared or arrive."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _strings(value: Any):
    """Every string in a decoded JSON value, keys included."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _has_lone_surrogate(value: Any) -> bool:
    for s in _strings(value):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return True
    return False


def decode_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying why not."""
    try:
        value = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise ApiError(400, "the request body has a string with an unpaired UTF-16 surrogate escape (\\ud800-"
                            "\\udfff): it is not valid Unicode text")
    return value
