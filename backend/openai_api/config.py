"""ApiConfig: everything the OpenAI front needs to know, in one place."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from splitfuse.models.gguf_checkpoint import prepare_checkpoint

MAX_SERVED_NAME_CHARS = 128
# '/'-separated segments of URL-safe characters (GET /v1/models/{name} takes it unescaped); no
# segment starts with '.', so no '.', '..' or empty segment a proxy or client could normalize away.
_SERVED_NAME = re.compile(r"[A-Za-z0-9_:@+-][A-Za-z0-9._:@+-]*(/[A-Za-z0-9_:@+-][A-Za-z0-9._:@+-]*)*")


def check_served_model_name(name: str) -> str:
    """`name` when it may be the served model's name (--served-model-name); ValueError naming the rule."""
    if not 0 < len(name) <= MAX_SERVED_NAME_CHARS or not _SERVED_NAME.fullmatch(name):
        raise ValueError(f"--served-model-name {name[:MAX_SERVED_NAME_CHARS + 1]!r} must be 1-{MAX_SERVED_NAME_CHARS} "
                         "characters of A-Z a-z 0-9 . _ - : @ + in '/'-separated parts, none empty or starting "
                         "with '.'")
    return name


@dataclass(kw_only=True)  # keywords only: a positional host once landed in triton_model
class ApiConfig:
    model_dir: str
    """The checkpoint the Triton server runs: its tokenizer (and chat template) is used here."""
    triton_grpc_url: str = "127.0.0.1:8001"
    """host:port of the running tritonserver's gRPC endpoint."""
    triton_model: str = "llm"
    """The name of our `llm` model in that server (`<prefix>llm` when rendered with a prefix)."""
    host: str = "127.0.0.1"
    port: int = 9000
    served_model_name: str | None = None
    """The `model` clients name, the only one taken for the base model (check_served_model_name);
    defaults to the checkpoint directory's name."""
    tokenizer: str | None = None
    """Tokenizer directory when it is not `model_dir` (the engine's `tokenizer` parameter)."""
    max_model_len: int | None = None
    """The engine's max_model_len, for chat requests without max_tokens; defaults to the
    checkpoint's max_position_embeddings, as the engine's does."""
    log_level: str = "info"
    max_body_bytes: int | None = None
    """The largest request body taken (413 beyond). None: 4 MiB, or what a prompt as long as the
    context accepts may need as JSON when that is more (body.default_body_limit)."""
    max_logprob_entries: int = 200_000
    """The most log-probability entries one request may ask for: n x max_tokens x (top_logprobs
    + 1), counted when it arrives (400 beyond). Each entry holds ~360 bytes of the front's memory
    until the answer is sent: ~70 MiB at this default."""
    lora_adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters the server serves (its lora_modules): name -> PEFT folder. A request whose
    `model` is an adapter's name is served by that adapter; /v1/models lists them."""
    allow_runtime_lora: bool = False
    """Whether clients may load and unload LoRA adapters (/v1/load_lora_adapter, behind the API
    key); off: those routes answer 403. The engine reads only folders under its lora_load_dir."""
    api_key: str | None = field(default=None, repr=False)
    """Clients must send `Authorization: Bearer <api_key>` on every /v1 route (None: no check).
    Read from $SPLITFUSE_API_KEY or a file (`key_from`), never taken from a command line."""
    triton_http_proxy: str | None = None
    """host:port of Triton's HTTP endpoint: the front then forwards Triton's HTTP API (/v2/...)
    there, behind `api_key` (triton_proxy.py). None: not forwarded."""

    def __post_init__(self) -> None:
        self.model_dir = prepare_checkpoint(self.model_dir)  # a GGUF file: its converted directory
        if self.served_model_name is not None:
            check_served_model_name(self.served_model_name)
        else:
            self.served_model_name = Path(self.model_dir).resolve().name
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.served_model_name in self.lora_adapters:  # one name, two models
            raise ValueError(f"LoRA adapter name {self.served_model_name!r} is the served model's name")
        if self.triton_http_proxy and self.api_key is None:  # it would be Triton's open API on our port
            raise ValueError("forwarding Triton's HTTP API (--triton-http-proxy) needs an API key")
        if self.max_logprob_entries < 1:
            raise ValueError(f"max_logprob_entries must be positive, got {self.max_logprob_entries}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model_dir

    def resolved_max_model_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 2048))


API_KEY_ENV = "SPLITFUSE_API_KEY"


def key_from(path: str | None, env: str = API_KEY_ENV) -> str | None:
    """A key kept off command lines: the first line of `path` when given, else $`env`, else None.
    An empty key is an error (it would let every client in while looking protected)."""
    if path:
        lines = Path(path).read_text().splitlines()
        key, source = (lines[0].strip() if lines else ""), path
    else:
        key = os.environ.get(env)
        source = f"${env}"
        if key is None:
            return None
        key = key.strip()
    if not key:
        raise ValueError(f"the API key from {source} is empty")
    return key
