"""python -m splitfuse.openai_api --model DIR [--triton-grpc-url HOST:PORT] [--host H] [--port P]
    [--served-model-name NAME] [--max-body-bytes N] [--triton-http-proxy HOST:PORT]"""

from __future__ import annotations

import argparse

from splitfuse.openai_api import ApiConfig, run
from splitfuse.openai_api.config import API_KEY_ENV, MAX_SERVED_NAME_CHARS, key_from
from splitfuse.utils.cli_help import DefaultsHelpFormatter


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m splitfuse.openai_api", formatter_class=DefaultsHelpFormatter,
                                 description="OpenAI-compatible API in front of a running splitfuse Triton server")
    ap.add_argument("--model", required=True, help="checkpoint directory the Triton server runs (for its tokenizer)")
    ap.add_argument("--triton-grpc-url", default="127.0.0.1:8001", help="tritonserver gRPC endpoint host:port")
    ap.add_argument("--triton-model", default="llm",
                    help="our llm model's name in that server (<prefix>llm when rendered with --model-name-prefix)")
    ap.add_argument("--host", default="127.0.0.1", help="address the front binds to (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=9000, help="port the front listens on")
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the name /v1/models lists and requests send as `model`, the only one for the base model "
                         f"(1-{MAX_SERVED_NAME_CHARS} characters of A-Z a-z 0-9 . _ - : @ + in '/'-separated parts; "
                         "default: the checkpoint directory's name)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default: the checkpoint's max_position_embeddings)")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter the Triton server serves (its lora_modules), repeatable: requests with "
                         "model=NAME use it")
    ap.add_argument("--allow-runtime-lora", action="store_true",
                    help="let clients load and unload LoRA adapters (/v1/load_lora_adapter, /v1/unload_lora_adapter; "
                         "behind the API key; the engine reads only folders under its lora_load_dir; default: off)")
    ap.add_argument("--log-level", default="info", help="uvicorn's log level (critical, error, warning, info, debug)")
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="largest request body taken, 413 beyond (default: 4 MiB, or more when a prompt as long as "
                         "the context accepts needs more)")
    ap.add_argument("--max-logprob-entries", type=int, default=ApiConfig.max_logprob_entries,
                    help="most log-probability entries one request may ask for, n x max_tokens x (top_logprobs + 1); "
                         "400 beyond (default: %(default)s)")
    ap.add_argument("--api-key-file", default=None,
                    help=f"file whose first line is the API key clients must send as a Bearer token (default: "
                         f"${API_KEY_ENV}; neither: no key is asked)")
    ap.add_argument("--triton-http-proxy", default=None, metavar="HOST:PORT",
                    help="forward Triton's HTTP API (/v2/...) to this Triton HTTP endpoint, behind the API key "
                         "(default: not forwarded; needs a key)")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        api_key = key_from(a.api_key_file)
        adapters = dict(_name_path(item) for item in a.lora)
        config = ApiConfig(model_dir=a.model, triton_grpc_url=a.triton_grpc_url, triton_model=a.triton_model,
                           host=a.host, port=a.port,
                           served_model_name=a.served_model_name, tokenizer=a.tokenizer,
                           max_model_len=a.max_model_len, log_level=a.log_level, api_key=api_key,
                           max_body_bytes=a.max_body_bytes, lora_adapters=adapters,
                           allow_runtime_lora=a.allow_runtime_lora,
                           max_logprob_entries=a.max_logprob_entries,
                           triton_http_proxy=a.triton_http_proxy)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    run(config)


def _name_path(item: str) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora expects NAME=PATH, got {item!r}")
    return name, path


if __name__ == "__main__":
    main()
