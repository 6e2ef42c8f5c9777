"""The FastAPI application: OpenAI routes over the Triton `llm` model.

Each route reads its body within --max-body-bytes (413 beyond), validates it (400 naming the
parameter), checks the model name (404), tokenizes, and runs a generation per choice through
`TritonLLM` (choices.py: the first, then the others on its cached prompt). Decoding, validation
and tokenizing (chat template included) run in a small pool of threads, not on the event loop:
a long prompt must not stall the other clients' streams.
Streaming answers are server-sent events; the first engine response is awaited before the 200
goes out, so a request the engine refuses still gets its 400 (or 429 when it is busy). A client
that goes away cancels its generation (see `TritonLLM.generate`), whether it was streaming or
waiting for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from splitfuse.openai_api import embeddings_route, lora_routes, openapi
from splitfuse.openai_api import responses as R
from splitfuse.openai_api import triton_proxy
from splitfuse.openai_api.auth import ApiKeyMiddleware
from splitfuse.openai_api.body import decode_json, default_body_limit, read_body
from splitfuse.openai_api.choice_output import ChatChoiceOutput, CompletionChoiceOutput
from splitfuse.openai_api.choices import run_choices
from splitfuse.openai_api.logprobs import check_budget as check_logprob_budget
from splitfuse.openai_api.config import ApiConfig
from splitfuse.openai_api.http_errors import error_response, generation_http_error, install_error_handlers
from splitfuse.openai_api.prompts import Prompts
from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from splitfuse.openai_api.response_output import Echo, ResponseOutput, response_events
from splitfuse.openai_api.responses_request import ResponsesRequest, parse_responses, responses_names, \
    responses_param
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
# Seeds are UINT64: choice i of a seeded request samples with (seed + i) modulo this.
SEED_MODULUS = 2**64


class ClientGone(Exception):
    """The HTTP client disconnected while its generation was running."""


ChoiceOutput = ChatChoiceOutput | CompletionChoiceOutput | ResponseOutput


@dataclass
class Job:
    """One request's generations as the routes describe them to the shared runner."""

    chat: bool
    meta: R.Meta
    prompt_ids: list[int]
    inputs: dict[str, Any]
    stream: bool
    include_usage: bool
    n: int
    new_output: Callable[[int], ChoiceOutput]
    """Choice i's output assembly."""
    guide_param: str | None = None
    """The parameter the output's guide came from (response_format or tools)."""
    responses: bool = False
    """Answered in the Responses API's shape (its one choice a ResponseOutput)."""

    def choice_inputs(self, i: int) -> dict[str, Any]:
        """Choice i's `llm` inputs: its own seed, and streamed when it must report its first
        response (choice 0 of several starts the others then)."""
        inputs = {"input_ids": self.prompt_ids, "input_lengths": len(self.prompt_ids),
                  "stream": self.stream or (i == 0 and self.n > 1), **self.inputs}
        if i and "seed" in inputs:
            inputs["seed"] = (inputs["seed"] + i) % SEED_MODULUS
        return inputs


def sampling_inputs(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: bool,
                    top_logprobs: int = 0) -> dict:
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
    if top_logprobs:
        inputs["return_top_log_probs"] = top_logprobs
    for name in ("presence_penalty", "frequency_penalty", "seed", "top_k", "min_tokens", "repetition_penalty",
                 "ignore_eos", "cache_salt", "priority"):
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
    def check_model(self, name: str) -> dict[str, Any]:
        """The `llm` inputs that select model `name`: none for the base, lora_name for an adapter."""
        if name in self.config.lora_adapters:
            return {"lora_name": name}
        if name != self.config.served_model_name:
            served = ", ".join(f"`{n}`" for n in self.model_names())
            raise ApiError(404, f"The model `{name}` does not exist. This server serves {served}.", param="model",
                           code="model_not_found")
        return {}

    def model_names(self) -> list[str]:
        return [self.config.served_model_name, *self.config.lora_adapters]

    def model_card(self, name: str) -> dict:
        base = self.config.served_model_name
        if name == base:
            return R.model_card(base, self.created, self.max_model_len)
        return R.model_card(name, self.created, self.max_model_len, parent=base)

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
        model = self.check_model(req.model)
        ids, text = self.prompts.completion(req)
        want_lp = req.logprobs is not None
        if want_lp and req.echo:
            raise ApiError(400, "echo with logprobs is not supported (prompt log-probabilities are not "
                                "computed)", param="echo")
        echo = text if req.echo else ""
        max_tokens = req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        if want_lp:
            check_logprob_budget(req.n, max_tokens, req.logprobs or 0, self.config.max_logprob_entries, "logprobs")
        return Job(chat=False, meta=R.Meta(R.new_id("cmpl"), req.model), prompt_ids=ids,
                   inputs={**sampling_inputs(req, max_tokens, want_lp, req.logprobs or 0), **model},
                   stream=req.stream,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage), n=req.n,
                   new_output=lambda i: CompletionChoiceOutput(i, req.logprobs, echo, self.prompts.token_strings))

    def chat_job(self, raw: bytes) -> Job:
        """A /v1/chat/completions body -> its generation (runs in the tokenizing threads)."""
        return self._chat_request_job(parse(ChatCompletionRequest, decode_json(raw)), R.new_id("chatcmpl"))

    def responses_job(self, raw: bytes) -> Job:
        """A /v1/responses body -> its generation: the chat request it says (responses_request.py)."""
        req: ResponsesRequest = parse_responses(decode_json(raw))
        with responses_names():
            job = self._chat_request_job(req.chat_request(), R.new_id("resp"))
        chat_output, echo = job.new_output, Echo.of(req)
        job.new_output = lambda i: ResponseOutput(job.meta, echo, chat_output(i))  # type: ignore[arg-type]
        job.responses, job.guide_param = True, responses_param(job.guide_param)
        return job

    def _chat_request_job(self, req: ChatCompletionRequest, job_id: str) -> Job:
        req.check()
        model = self.check_model(req.model)
        ids = self.prompts.chat(req)
        max_tokens = req.max_new_tokens() or self.default_max_tokens(len(ids))
        top = (req.top_logprobs or 0) if req.logprobs else 0
        if req.logprobs:
            check_logprob_budget(req.n, max_tokens, top, self.config.max_logprob_entries, "top_logprobs")
        inputs = {**sampling_inputs(req, max_tokens, req.logprobs, top), **model}
        guide = req.guide()
        if guide is not None:
            inputs["guided_decoding_guide_type"] = guide[0]
            if guide[1]:
                inputs["guided_decoding_guide"] = guide[1]
        mode = req.tool_mode()
        return Job(chat=True, meta=R.Meta(job_id, req.model), prompt_ids=ids, inputs=inputs,
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   n=req.n, new_output=lambda i: ChatChoiceOutput(i, mode, req.logprobs, self.prompts.token_strings),
                   guide_param=None if guide is None else "tools" if mode == "forced" else "response_format")

    def _choices(self, job: Job) -> AsyncIterator[tuple[int, Step]]:
        assert self.triton is not None
        triton = self.triton
        # One request id per generation: Triton's logs and the engine tell the choices apart.
        return run_choices(lambda i: triton.generate(f"{job.meta.id}-{i}" if job.n > 1 else job.meta.id,
                                                     job.choice_inputs(i)), job.n)

    async def complete(self, job: Job, request: Request) -> dict:
        """Non-streaming: every choice's responses gathered into its whole answer."""
        outputs = [job.new_output(i) for i in range(job.n)]
        n_in: int | None = None

        async def collect() -> None:
            nonlocal n_in
            async with contextlib.aclosing(self._choices(job)) as items:
                async for i, step in items:
                    n_in = step.num_input_tokens or n_in
                    outputs[i].step(step)

        await _watch_disconnect(request, collect())
        n_out = sum(o.tokens.num_output for o in outputs)
        if job.responses:
            assert isinstance(outputs[0], ResponseOutput)
            return outputs[0].whole((n_in or len(job.prompt_ids), n_out))
        use = R.usage(n_in or len(job.prompt_ids), n_out)
        choices = [o.whole() for o in outputs]
        return R.chat(job.meta, choices, use) if job.chat else R.completion(job.meta, choices, use)

    async def stream(self, job: Job, request: Request) -> StreamingResponse:
        items = self._choices(job)
        try:
            first = await _watch_disconnect(request, items.__anext__())
        except BaseException:
            await items.aclose()
            raise
        if job.responses:
            output = job.new_output(0)
            assert isinstance(output, ResponseOutput)
            events = response_events(output, items, first, len(job.prompt_ids))
        else:
            events = self._events(job, items, first)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, job: Job, items: AsyncIterator[tuple[int, Step]],
                      first: tuple[int, Step]) -> AsyncIterator[str]:
        meta = job.meta
        chunk = R.chat_chunk if job.chat else R.completion_chunk
        outputs = [job.new_output(i) for i in range(job.n)]
        n_in = first[1].num_input_tokens
        try:
            async with contextlib.aclosing(items):
                # Every choice opens in index order: the SDK's stream accumulation places a
                # choice by the order it first appears.
                opening = [c for c in (o.first() for o in outputs) if c is not None]
                if opening:
                    yield R.sse(chunk(meta, opening))
                item: tuple[int, Step] | None = first
                while item is not None:
                    i, step = item
                    n_in = step.num_input_tokens or n_in
                    choice = outputs[i].step(step)
                    if choice is not None:
                        yield R.sse(chunk(meta, [choice]))
                    item = await anext(items, None)
        except GenerationError as e:
            log.warning("%s: generation failed mid-stream: %s", meta.id, e.message)
            yield R.sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})
            yield R.sse("[DONE]")
            return
        if job.include_usage:
            use = R.usage(n_in or len(job.prompt_ids), sum(o.tokens.num_output for o in outputs))
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
            return error_response(generation_http_error(e, job.guide_param))
        except ClientGone:
            log.info("%s: client disconnected; generation cancelled", job.meta.id)
            return JSONResponse({}, status_code=499)

    install_error_handlers(app)
    if config.api_key is not None:
        # Around the whole app: guards every route, those mounted later too (auth.OPEN_PATHS aside).
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    triton_proxy.install(app, config, server.max_body_bytes)  # off unless --triton-http-proxy
    lora_routes.install(app)  # 403 unless --allow-runtime-lora

    @app.get("/v1/models", **openapi.MODELS_ROUTE)
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card(name) for name in server.model_names()]}

    @app.get("/v1/models/{name:path}", **openapi.MODEL_ROUTE)
    async def model(name: str) -> dict:
        server.check_model(name)
        return server.model_card(name)

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

    @app.post("/v1/responses", **openapi.responses_route())
    async def responses(request: Request):
        return await run(server.responses_job, request)
    embeddings_route.install(app, server)

    return app


def run(config: ApiConfig) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    import uvicorn

    if not Path(config.model_dir).is_dir():
        raise FileNotFoundError(f"model directory {config.model_dir} does not exist")
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level)
