"""OpenAI response bodies and stream chunks, built from plain values (testable without Triton)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Meta:
    """What every body of one response shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


# ---- /v1/completions ------------------------------------------------------------------------


def completion_logprobs(tokens: list[str], logprobs: list[float], text_start: int) -> dict:
    """The legacy `logprobs` object; offsets count characters of the choice's text."""
    offsets, pos = [], text_start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def completion(meta: Meta, text: str, finish_reason: str | None, logprobs: dict | None, use: dict) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(meta: Meta, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def completion_usage_chunk(meta: Meta, use: dict) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [], "usage": use}


# ---- /v1/chat/completions -------------------------------------------------------------------


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def chat(meta: Meta, text: str, finish_reason: str | None, logprobs: dict | None, use: dict) -> dict:
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(meta: Meta, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_usage_chunk(meta: Meta, use: dict) -> dict:
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [], "usage": use}


# ---- /v1/models -----------------------------------------------------------------------------


def model_card(name: str, created: int, root: str, max_model_len: int) -> dict:
    """As vLLM's, with the longest prompt + generation the engine takes."""
    return {"id": name, "object": "model", "created": created, "owned_by": "splitfuse", "root": root,
            "max_model_len": max_model_len}
