"""The FastAPI application: OpenAI routes over the Triton `llm` model.

Each route reads its body within --max-body-bytes (413 beyond), validates it (400 naming the
parameter), checks the model name (404), tokenizes, and runs one generation through
`TritonLLM`. Decoding, validation and tokenizing (chat template included) run in a small pool
of threads, not on the event loop: a long prompt must not stall the other clients' streams.
Streaming answers are server-sent events; the first engine response is awaited before the 200
goes out, so a request the engine refuses still gets its 400 (or 429 when it is busy). A client
that goes away cancels its generation (see `TritonLLM.generate`), whether it was streaming or
waiting for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from splitfuse.openai_api import openapi
from splitfuse.openai_api import responses as R
from splitfuse.openai_api.body import decode_json, default_body_limit, read_body
from splitfuse.openai_api.config import ApiConfig
from splitfuse.openai_api.prompts import Prompts
from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from splitfuse.openai_api.triton_llm import GenerationError, Step, TritonLLM

log = logging.getLogger("splitfuse.openai_api")
T = TypeVar("T")

# How often a waiting (non-streaming) request checks that its client is still connected.
DISCONNECT_POLL_S = 0.1
# OpenAI's default for /v1/completions (chat defaults to what fits in max_model_len).
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Threads that decode, validate and tokenize request bodies: `tokenizer(text)` (batch encoding in
# the Rust core) releases the GIL, and two keep one huge prompt from delaying every other
# request's tokenizing.
TOKENIZE_THREADS = 2
# What a client told to retry waits (seconds): the engine's queue moves within a few steps.
RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The HTTP client disconnected while its generation was running."""


@dataclass
class Job:
    """One generation as the routes describe it to the shared runner."""

    chat: bool
    meta: R.Meta
    prompt_ids: list[int]
    inputs: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: str = ""


def sampling_inputs(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: bool) -> dict:
    """OpenAI parameters -> `llm` inputs. Temperature and top_p are always sent, with OpenAI's
    defaults (1.0), so the answer does not depend on the server's own default sampling."""
    inputs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "return_log_probs": logprobs,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    for name in ("presence_penalty", "frequency_penalty", "seed", "top_k", "min_tokens", "repetition_penalty",
                 "ignore_eos", "cache_salt"):
        value = getattr(req, name)
        if value is not None:
            inputs[name] = value
    stops = req.stop_list()
    if stops:
        inputs["stop_words"] = stops
    return inputs


class OpenAIServer:
    """State shared by the routes: config, tokenizer, Triton client."""

    def __init__(self, config: ApiConfig, tokenizer: Any | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.max_model_len = config.resolved_max_model_len()
        self.prompts = Prompts(tokenizer or AutoTokenizer.from_pretrained(config.tokenizer_dir), self.max_model_len)
        self.max_body_bytes = self._body_limit()
        self.created = int(time.time())
        self.triton: TritonLLM | None = None
        self.pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="splitfuse-tokenize")

    def _body_limit(self) -> int:
        needed = default_body_limit(self.prompts.limit.max_chars)
        if self.config.max_body_bytes is None:
            return needed
        if self.config.max_body_bytes < needed:
            log.warning("--max-body-bytes %d is below the %d bytes a prompt of the longest accepted length (%d "
                        "characters) may need as JSON: such prompts get a 413", self.config.max_body_bytes, needed,
                        self.prompts.limit.max_chars)
        return self.config.max_body_bytes

    # ---- lifecycle (the gRPC channel belongs to the server's event loop) ----------------------
    async def start(self) -> None:
        self.triton = TritonLLM(self.config.triton_grpc_url, self.config.triton_model)

    async def stop(self) -> None:
        if self.triton is not None:
            await self.triton.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizing threads; its exceptions (ApiError) reach the caller."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- requests ------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.config.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves "
                                f"`{self.config.served_model_name}`.", param="model", code="model_not_found")

    def default_max_tokens(self, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                                f"max_model_len {self.max_model_len}", param="messages")
        return room

    def completion_job(self, raw: bytes) -> Job:
        """A /v1/completions body -> its generation (runs in the tokenizing threads)."""
        req = parse(CompletionRequest, decode_json(raw))
        req.check_stream_options()
        self.check_model(req.model)
        ids, text = self.prompts.completion(req)
        want_lp = req.logprobs is not None
        if want_lp and req.echo:
            raise ApiError(400, "echo with logprobs is not supported (prompt log-probabilities are not "
                                "computed)", param="echo")
        return Job(chat=False, meta=R.Meta(R.new_id("cmpl"), req.model), prompt_ids=ids,
                   inputs=sampling_inputs(req, req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, want_lp),
                   stream=req.stream,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   logprobs=want_lp, echo=text if req.echo else "")

    def chat_job(self, raw: bytes) -> Job:
        """A /v1/chat/completions body -> its generation (runs in the tokenizing threads)."""
        req = parse(ChatCompletionRequest, decode_json(raw))
        req.check_stream_options()
        self.check_model(req.model)
        ids = self.prompts.chat(req)
        max_tokens = req.max_new_tokens() or self.default_max_tokens(len(ids))
        return Job(chat=True, meta=R.Meta(R.new_id("chatcmpl"), req.model), prompt_ids=ids,
                   inputs=sampling_inputs(req, max_tokens, req.logprobs), stream=req.stream,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   logprobs=req.logprobs)

    def _steps(self, job: Job) -> AsyncIterator[Step]:
        assert self.triton is not None
        inputs = {"input_ids": job.prompt_ids, "input_lengths": len(job.prompt_ids), "stream": job.stream,
                  **job.inputs}
        return self.triton.generate(job.meta.id, inputs)

    def _logprobs(self, job: Job, step_ids: list[int], step_lps: list[float] | None, text_start: int):
        if not job.logprobs:
            return None
        tokens = self.prompts.token_strings(step_ids)
        lps = list(step_lps or [])
        if job.chat:
            return R.chat_logprobs(tokens, lps)
        return R.completion_logprobs(tokens, lps, text_start)

    async def complete(self, job: Job, request: Request) -> dict:
        """Non-streaming: one response from `llm` with the whole text."""
        async def collect() -> Step:
            async with contextlib.aclosing(self._steps(job)) as steps:
                async for step in steps:
                    if step.final:
                        return step
            raise GenerationError("no final response")

        step = await _watch_disconnect(request, collect())
        use = R.usage(step.num_input_tokens or len(job.prompt_ids), step.num_output_tokens or len(step.token_ids))
        text = job.echo + step.text
        lp = self._logprobs(job, step.token_ids, step.logprobs, len(job.echo))
        if job.chat:
            return R.chat(job.meta, text, step.finish_reason, lp, use)
        return R.completion(job.meta, text, step.finish_reason, lp, use)

    async def stream(self, job: Job, request: Request) -> StreamingResponse:
        steps = self._steps(job)
        try:
            first = await _watch_disconnect(request, steps.__anext__())
        except BaseException:
            await steps.aclose()
            raise
        return StreamingResponse(self._events(job, steps, first), media_type="text/event-stream")

    async def _events(self, job: Job, steps: AsyncIterator[Step], first: Step) -> AsyncIterator[str]:
        meta = job.meta
        n_in, n_out = first.num_input_tokens, 0
        text_len = 0
        try:
            async with contextlib.aclosing(steps):
                if job.chat:
                    yield R.sse(R.chat_chunk(meta, {"role": "assistant", "content": ""}, None, None))
                elif job.echo:
                    yield R.sse(R.completion_chunk(meta, job.echo, None, None))
                    text_len = len(job.echo)
                step: Step | None = first
                while step is not None:
                    n_in = step.num_input_tokens or n_in
                    n_out = step.num_output_tokens if step.num_output_tokens is not None else n_out + len(
                        step.token_ids)
                    if step.text or step.token_ids or step.finish_reason:
                        lp = self._logprobs(job, step.token_ids, step.logprobs, text_len)
                        text_len += len(step.text)
                        if job.chat:
                            delta = {"content": step.text} if step.text else {}
                            yield R.sse(R.chat_chunk(meta, delta, step.finish_reason, lp))
                        else:
                            yield R.sse(R.completion_chunk(meta, step.text, step.finish_reason, lp))
                    step = None if step.final else await steps.__anext__()
        except (GenerationError, StopAsyncIteration) as e:
            message = e.message if isinstance(e, GenerationError) else "the generation ended without a final response"
            log.warning("%s: generation failed mid-stream: %s", meta.id, message)
            yield R.sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
            yield R.sse("[DONE]")
            return
        if job.include_usage:
            use = R.usage(n_in or len(job.prompt_ids), n_out)
            yield R.sse(R.chat_usage_chunk(meta, use) if job.chat else R.completion_usage_chunk(meta, use))
        yield R.sse("[DONE]")


async def _watch_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its generation) if the HTTP client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def generation_http_error(e: GenerationError) -> ApiError:
    """How a Triton error reaches the HTTP client: 429 when the engine is too busy to take the
    request now (OpenAI's rate-limit answer, which its SDK retries after Retry-After), 400 for
    what the request asked, 503 when the server is unavailable or shutting down."""
    if e.is_busy:
        return ApiError(429, e.message, type_="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if e.is_client_error:
        return ApiError(400, e.message)
    return ApiError(503, e.message, type_="server_error")


def build_app(config: ApiConfig, tokenizer: Any | None = None) -> FastAPI:
    """The ASGI application for `config` (run it with uvicorn, see `run`)."""
    server = OpenAIServer(config, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="splitfuse OpenAI-compatible API", lifespan=lifespan)
    app.state.server = server
    openapi.install(app, api_key=config.api_key is not None)

    async def run(make_job: Callable[[bytes], Job], request: Request):
        try:
            raw = await read_body(request, server.max_body_bytes)
        except ClientDisconnect:  # gone before its body was in: nobody to answer
            return JSONResponse({}, status_code=499)
        job = await server.off_loop(make_job, raw)
        try:
            if job.stream:
                return await server.stream(job, request)
            return JSONResponse(await server.complete(job, request))
        except GenerationError as e:
            return _error_response(generation_http_error(e))
        except ClientGone:
            log.info("%s: client disconnected; generation cancelled", job.meta.id)
            return JSONResponse({}, status_code=499)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # No route (e.g. a model name with a newline, which the path converter does not match)
        # or method: OpenAI's error shape too, not Starlette's {"detail": ...}.
        message = (f"invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
                   else f"{exc.detail} ({request.method} {request.url.path})")
        return _error_response(ApiError(exc.status_code, message, headers=exc.headers))

    if config.api_key is not None:
        expected = f"Bearer {config.api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            # Every /v1 route; /health stays open for probes.
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _error_response(ApiError(401, "a valid API key is required: send the header "
                                                         "'Authorization: Bearer <key>'", code="invalid_api_key"))
            return await call_next(request)

    @app.get("/v1/models", **openapi.MODELS_ROUTE)
    async def models() -> dict:
        return {"object": "list", "data": [R.model_card(config.served_model_name, server.created, config.model_dir,
                                                          server.max_model_len)]}

    @app.get("/v1/models/{name:path}", **openapi.MODEL_ROUTE)
    async def model(name: str) -> dict:
        server.check_model(name)
        return R.model_card(name, server.created, config.model_dir, server.max_model_len)

    @app.get("/health", **openapi.HEALTH_ROUTE)
    async def health() -> JSONResponse:
        ok = server.triton is not None and await server.triton.ready()
        return JSONResponse({"triton_llm_ready": ok}, status_code=200 if ok else 503)

    @app.post("/v1/completions",
              **openapi.generation_route(CompletionRequest, openapi.CompletionResponse, openapi.CompletionChunk))
    async def completions(request: Request):
        return await run(server.completion_job, request)

    @app.post("/v1/chat/completions",
              **openapi.generation_route(ChatCompletionRequest, openapi.ChatCompletionResponse,
                                         openapi.ChatCompletionChunk))
    async def chat_completions(request: Request):
        return await run(server.chat_job, request)

    return app


def run(config: ApiConfig) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    import uvicorn

    if not Path(config.model_dir).is_dir():
        raise FileNotFoundError(f"model directory {config.model_dir} does not exist")
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level)
