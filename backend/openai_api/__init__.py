"""An OpenAI-compatible HTTP front (FastAPI) for a running Triton server.

A thin client: it tokenizes (chat template included) and streams each request to the `llm`
model over tritonclient's asyncio gRPC API, so Triton stays the server (metrics, instances,
other models). Run it beside Triton:

    python -m splitfuse.openai_api --model DIR --triton-grpc-url 127.0.0.1:8001 --port 9000

or from Python: `run(ApiConfig(model_dir=DIR, triton_grpc_url="127.0.0.1:8001", port=9000))`, or mount
`build_app(config)` in an ASGI server of your own.
"""

from splitfuse.openai_api.config import ApiConfig


def build_app(config: ApiConfig, tokenizer=None):
    from splitfuse.openai_api.app import build_app as _build

    return _build(config, tokenizer)


def run(config: ApiConfig) -> None:
    from splitfuse.openai_api.app import run as _run

    _run(config)


__all__ = ["ApiConfig", "build_app", "run"]
