"""How errors reach an HTTP client of the OpenAI front: OpenAI's error shape for every route, and
the status a Triton error maps to."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitfuse.openai_api.protocol import ApiError
from splitfuse.openai_api.triton_llm import GenerationError

# What a client told to retry waits (seconds): the engine's queue moves within a few steps.
RETRY_AFTER_S = 1


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def generation_http_error(e: GenerationError, guide_param: str | None = None) -> ApiError:
    """How a Triton error reaches the HTTP client, by its gRPC status (not its words): 429 when
    the engine is too busy to take the request now (OpenAI's rate-limit answer), 400 for what the
    request asked (INVALID_ARGUMENT), 503 for everything else: the server's own faults, its
    shutdown, a model not loaded. Both with Retry-After, which OpenAI's SDKs honour when they
    retry (they retry 429 and 5xx, never 400). A guide `llm` refused (a schema xgrammar does
    not compile) names the parameter it came from."""
    if e.is_busy:
        return ApiError(429, e.message, type_="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if e.is_client_error:
        if guide_param is not None and "guided_decoding_guide" in e.message:
            return ApiError(400, f"{guide_param}: the schema was refused: {e.message}", param=guide_param)
        return ApiError(400, e.message)
    return ApiError(503, e.message, type_="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # No route (e.g. a model name with a newline, which the path converter does not match)
        # or method: OpenAI's error shape too, not Starlette's {"detail": ...}.
        message = (f"invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
                   else f"{exc.detail} ({request.method} {request.url.path})")
        return error_response(ApiError(exc.status_code, message, headers=exc.headers))
