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


# ---- /v1/completions (choices from choice_output.py) -------------------------------------


def completion(meta: Meta, choices: list[dict], use: dict) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": use}


def completion_chunk(meta: Meta, choices: list[dict]) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": choices}


def completion_usage_chunk(meta: Meta, use: dict) -> dict:
    return {**completion_chunk(meta, []), "usage": use}


# ---- /v1/chat/completions -------------------------------------------------------------------


def chat(meta: Meta, choices: list[dict], use: dict) -> dict:
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": use}


def chat_chunk(meta: Meta, choices: list[dict]) -> dict:
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": choices}


def chat_usage_chunk(meta: Meta, use: dict) -> dict:
    return {**chat_chunk(meta, []), "usage": use}


# ---- /v1/models -----------------------------------------------------------------------------


def model_card(name: str, created: int, max_model_len: int, parent: str | None = None) -> dict:
    """As vLLM's, with the longest prompt + generation the engine takes; a LoRA adapter's has its
    base model's name as `parent`. `root` is the served name, never a folder of the server:
    the card must not show clients the server's file system."""
    return {"id": name, "object": "model", "created": created, "owned_by": "splitfuse", "root": name,
            "parent": parent, "max_model_len": max_model_len}
