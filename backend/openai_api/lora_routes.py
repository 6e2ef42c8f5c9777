"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies).

Off unless the operator starts the front with --allow-runtime-lora (a 403 naming the option
otherwise), behind the API key like every /v1 route. The front forwards the request to Triton's
`llm` model as a control request (lora_load + lora_path, or lora_unload), which every instance
applies and which reads only folders under the engine's lora_load_dir (lora_admin.py); the front
then lists the adapter in /v1/models and takes requests with model=<its name>.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from splitfuse.config import LORA_NAME
from splitfuse.openai_api import openapi
from splitfuse.openai_api.body import decode_json, read_body
from splitfuse.openai_api.protocol import ApiError, parse
from splitfuse.openai_api.strict import Strict
from splitfuse.openai_api.triton_llm import GenerationError

MAX_PATH_CHARS = 4096


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(pattern=f"^{LORA_NAME.pattern}$", description="the adapter's name: requests send it as `model`")
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS,
                           description="its PEFT folder, under the server's lora_load_dir (relative: from there)")


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(pattern=f"^{LORA_NAME.pattern}$")


def _route(model: type[Strict], ok: str) -> dict[str, Any]:
    errors = openapi.error_responses(400, 401, 404, 413, 429, 503)
    errors[403] = {**errors[400], "description": "run-time LoRA updating is off (--allow-runtime-lora)"}
    return {"response_model": None,
            "openapi_extra": {"requestBody": {"required": True,
                                              "content": {"application/json": {"schema": model.model_json_schema()}}}},
            "responses": {200: {"description": ok, "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **errors}}


async def _forward(request: Request, model: type[Strict]) -> Any:
    server = request.app.state.server
    if not server.config.allow_runtime_lora:
        raise ApiError(403, "loading and unloading LoRA adapters at run time is off on this server (the operator "
                            "enables it with --allow-runtime-lora)", type_="permission_error")
    body = parse(model, decode_json(await read_body(request, server.max_body_bytes)))
    if body.lora_name == server.config.served_model_name:
        raise ApiError(400, f"lora_name: {body.lora_name!r} is the served model's name", param="lora_name")
    inputs = ({"lora_load": body.lora_name, "lora_path": body.lora_path} if isinstance(body, LoadLoraAdapterRequest)
              else {"lora_unload": body.lora_name})
    try:
        async with contextlib.aclosing(server.triton.generate(f"lora-{secrets.token_hex(8)}", inputs)) as steps:
            async for step in steps:
                message = step.text
    except GenerationError as e:
        if e.code == "NOT_FOUND":
            raise ApiError(404, e.message, param="lora_name", code="lora_not_found") from None
        if e.is_client_error:
            raise ApiError(400, e.message, param="lora_path" if "lora_path" in e.message else "lora_name") from None
        raise ApiError(503, e.message, type_="server_error") from None
    return body, message


def install(app: FastAPI) -> None:
    """Add the two routes (their requests refused with 403 unless allow_runtime_lora)."""

    @app.post("/v1/load_lora_adapter", **_route(LoadLoraAdapterRequest, "the adapter is loaded"))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body, message = await _forward(request, LoadLoraAdapterRequest)
        config = request.app.state.server.config
        # Replaced, not changed in place: the tokenizing threads read it (check_model) meanwhile.
        config.lora_adapters = {**config.lora_adapters, body.lora_name: body.lora_path}
        return PlainTextResponse(f"Success: {message}")

    @app.post("/v1/unload_lora_adapter", **_route(UnloadLoraAdapterRequest, "the adapter is unloaded"))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body, message = await _forward(request, UnloadLoraAdapterRequest)
        config = request.app.state.server.config
        config.lora_adapters = {n: p for n, p in config.lora_adapters.items() if n != body.lora_name}
        return PlainTextResponse(f"Success: {message}")
