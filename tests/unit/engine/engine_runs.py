"""Driving an LLMEngine by hand in the engine's unit tests."""

from __future__ import annotations

from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.sequence import RequestOutput


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left; each request's final output, by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals
