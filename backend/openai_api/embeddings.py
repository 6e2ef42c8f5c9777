"""/v1/embeddings: the body OpenAI's SDK sends (`client.embeddings.create`) and the answer built
from the engine's vectors (each input's pooled, L2-normalised final hidden state)."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from splitfuse.openai_api.protocol import ApiError

# Inputs per request (OpenAI allows 2048): each is a sequence of its own in the engine's steps,
# and one request should not fill the queue that every client shares.
MAX_EMBEDDING_INPUTS = 256

_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _many(item: dict) -> dict:
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: Annotated[str | list[str] | list[int] | list[list[int]],
                     WithJsonSchema({"anyOf": [_TEXT, _many(_TEXT), _TOKEN_IDS, _many(_TOKEN_IDS)]})]
    """One text, several texts, one token-id list or several."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector as its little-endian float32 bytes (what the openai SDK asks for)."""
    dimensions: Annotated[int | None, WithJsonSchema({"type": "null"})] = Field(default=None)
    """Refused: the vectors have the model's hidden size (no Matryoshka truncation)."""
    user: str | None = None  # accepted, no effect

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            v = [v]
        if not v:
            raise ValueError("input is empty")
        if len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(v)}")
        if any(len(item) == 0 for item in v):
            raise ValueError("input must not contain an empty string or token list")
        return v

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("dimensions is not supported: the embeddings have the model's hidden size")
        return v

    def items(self) -> list[str | list[int]]:
        """The inputs, one per vector (a single one as a list of one)."""
        return self.input  # type: ignore[return-value]  # made a list by _inputs


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return np.asarray(vector, np.float32).tolist()


def embedding_answer(req: EmbeddingRequest, vectors: list[np.ndarray], prompt_tokens: int) -> dict:
    """OpenAI's answer: one `embedding` object per input, in input order, and the usage."""
    if len(vectors) != len(req.items()):
        raise ApiError(503, f"{len(vectors)} vectors for {len(req.items())} inputs", type_="server_error")
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
