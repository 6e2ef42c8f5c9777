"""POST /v1/embeddings: each input a prompt-only request of `llm` (`embeddings_only`), all sent at
once so that the engine computes them in the same steps as everything else; the answer in input
order (embeddings.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from splitfuse.openai_api import openapi
from splitfuse.openai_api import responses as R
from splitfuse.openai_api.body import decode_json, read_body
from splitfuse.openai_api.embeddings import EmbeddingRequest, embedding_answer
from splitfuse.openai_api.http_errors import error_response, generation_http_error
from splitfuse.openai_api.protocol import ApiError, parse
from splitfuse.openai_api.triton_llm import GenerationError, TritonLLM

if TYPE_CHECKING:
    from splitfuse.openai_api.app import OpenAIServer


async def _vector(triton: TritonLLM, request_id: str, inputs: dict) -> np.ndarray:
    """One input's vector: the final response of its `llm` request."""
    async with contextlib.aclosing(triton.generate(request_id, inputs)) as steps:
        async for step in steps:
            if step.final:
                if step.embedding is None:
                    raise GenerationError("unavailable: llm answered without an embeddings output")
                return step.embedding
    raise GenerationError("unavailable: llm ended without a final response")


async def _vectors(triton: TritonLLM, job_id: str, prompts: list[list[int]], model: dict) -> list[np.ndarray]:
    """Every input's vector; the first failure cancels the others (their streams, and so the
    engine's requests)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_vector(triton, f"{job_id}-{i}",
                                               {"input_ids": ids, "input_lengths": len(ids), "embeddings_only": True,
                                                **model}))
                     for i, ids in enumerate(prompts)]
    except ExceptionGroup as failed:
        errors = [e for e in failed.exceptions if isinstance(e, GenerationError)]
        if not errors:
            raise
        raise errors[0] from None
    return [t.result() for t in tasks]


def install(app: FastAPI, server: OpenAIServer) -> None:
    """Add the route."""

    def prepare(raw: bytes) -> tuple[EmbeddingRequest, list[list[int]], dict]:
        """Parse, check the model and tokenize (in the tokenizing threads)."""
        req = parse(EmbeddingRequest, decode_json(raw))
        model = server.check_model(req.model)
        return req, [server.prompts.plain(item, "input") for item in req.items()], model

    @app.post("/v1/embeddings", **openapi.embeddings_route())
    async def embeddings(request: Request):
        try:
            raw = await read_body(request, server.max_body_bytes)
        except ClientDisconnect:  # gone before its body was in: nobody to answer
            return JSONResponse({}, status_code=499)
        req, prompts, model = await server.off_loop(prepare, raw)
        assert server.triton is not None
        try:
            vectors = await _vectors(server.triton, R.new_id("embd"), prompts, model)
        except GenerationError as e:
            return error_response(generation_http_error(e))
        return JSONResponse(embedding_answer(req, vectors, sum(len(ids) for ids in prompts)))
