"""The one place that talks to Triton: the `llm` model over tritonclient's asyncio gRPC stream.

Requests go to `llm` directly (with `input_ids`), not to `ensemble`: cancelling a gRPC stream
reaches a decoupled model, which aborts the sequence and frees its KV blocks, whereas Triton
2.51 does not forward an ensemble request's cancellation to its running step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

# SERVER_BUSY: how llm's refusals for load start; ERROR_CODE_PARAMETER: llm's errors then carry their status.
from splitfuse.errors import ERROR_CODE_PARAMETER, REPLICA_RETIRED, SERVER_BUSY, split_error_code

LLM_MODEL = "llm"

# Triton dtype of each `llm` input this front sends (model_repository/llm/config.pbtxt).
INPUT_DTYPES = {
    "input_ids": ("INT32", np.int32), "input_lengths": ("INT32", np.int32), "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", np.bool_), "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "repetition_penalty": ("FP32", np.float32),
    "min_tokens": ("INT32", np.int32), "seed": ("UINT64", np.uint64), "ignore_eos": ("BOOL", np.bool_),
    "stop_words": ("BYTES", np.object_), "return_log_probs": ("BOOL", np.bool_),
    "return_num_input_tokens": ("BOOL", np.bool_), "return_num_output_tokens": ("BOOL", np.bool_),
    "cache_salt": ("BYTES", np.object_), "return_top_log_probs": ("INT32", np.int32),
    "guided_decoding_guide_type": ("BYTES", np.object_), "guided_decoding_guide": ("BYTES", np.object_),
    "lora_name": ("BYTES", np.object_), "priority": ("INT32", np.int32), "embeddings_only": ("BOOL", np.bool_),
    "lora_load": ("BYTES", np.object_), "lora_path": ("BYTES", np.object_), "lora_unload": ("BYTES", np.object_),
}


# Sent with every request: llm leads its error messages with their gRPC status (INVALID_ARGUMENT,
# UNAVAILABLE, ...), which a stream's in-band error lacks. Not Triton's `triton_grpc_error` header:
# 2.51 crashes, now and then, on the streams that header makes it end with an error status.
CODED_ERRORS = {ERROR_CODE_PARAMETER: True}
# The status of what the request itself asked wrong (the llm model's TritonError.INVALID_ARG).
CLIENT_ERROR_CODES = frozenset({"INVALID_ARGUMENT"})


class GenerationError(Exception):
    """Triton answered a request with an error; `code` is its gRPC status name (None: an error
    Triton reports before any model sees the request, e.g. the model is not loaded)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def is_busy(self) -> bool:
        """Refused for load, not for what it asks: the same request may succeed later."""
        return self.message.startswith(SERVER_BUSY)

    @property
    def is_client_error(self) -> bool:
        """Only what `llm` refused as INVALID_ARG is the request's fault; every other status, and an
        error without one, is the server's (faults, shutdown, the model gone)."""
        return not self.is_busy and self.code in CLIENT_ERROR_CODES


@dataclass
class Step:
    """One response of `llm`: a delta when streaming, everything otherwise."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int | None
    final: bool
    top_ids: list[list[int]] | None = None
    """With return_top_log_probs=k: per token, the k most likely token ids (most likely first)."""
    top_logprobs: list[list[float]] | None = None
    """Their log-probabilities, as top_ids."""
    embedding: np.ndarray | None = None
    """With embeddings_only: the prompt's vector (float32), on the final response."""


def _code_name(status: str | None) -> str | None:
    """tritonclient's status text ("StatusCode.INVALID_ARGUMENT") as the bare name."""
    return None if not status else status.removeprefix("StatusCode.")


def build_inputs(values: dict[str, Any]) -> list:
    """{name: value or list} -> [1, 1] / [1, n] gRPC inputs, typed as `llm` declares them."""
    out = []
    for name, value in values.items():
        dtype, np_type = INPUT_DTYPES[name]
        row = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            row = [v.encode("utf-8") for v in row]
        arr = np.array([row], dtype=np_type)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def parse_step(result) -> Step:
    def get(name: str):
        arr = result.as_numpy(name)
        return None if arr is None else arr.reshape(-1)

    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    text = get("text_output")
    ids = get("output_ids")
    reason = get("finish_reason")
    lps = get("log_probs")
    n_in, n_out = get("num_input_tokens"), get("num_output_tokens")
    top_ids, top_lps = result.as_numpy("top_log_prob_ids"), result.as_numpy("top_log_probs")
    finish = bytes(reason[0]).decode() if reason is not None and reason.size else ""
    return Step(
        text=b"".join(bytes(t) for t in text).decode("utf-8") if text is not None else "",
        token_ids=ids.astype(int).tolist() if ids is not None else [],
        logprobs=lps.astype(float).tolist() if lps is not None else None,
        finish_reason=finish or None,
        num_input_tokens=int(n_in[0]) if n_in is not None and n_in.size else None,
        num_output_tokens=int(n_out[0]) if n_out is not None and n_out.size else None,
        # The last response of a generation carries its finish reason.
        final=final or bool(finish),
        top_ids=_rows(top_ids, int),
        top_logprobs=_rows(top_lps, float),
        embedding=get("embeddings"),
    )


def _rows(arr, kind: type) -> list[list] | None:
    """A [1, tokens, k] output as one list of k values per token."""
    if arr is None or arr.ndim == 0 or arr.shape[-1] == 0:
        return None
    return arr.reshape(-1, arr.shape[-1]).astype(kind).tolist()


class TritonLLM:
    """An asyncio client of the `llm` model; one gRPC channel, one stream per generation."""

    def __init__(self, grpc_url: str, model_name: str = LLM_MODEL) -> None:
        self.grpc_url = grpc_url
        self.model_name = model_name
        self.client = grpcaio.InferenceServerClient(grpc_url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_model_ready(self.model_name)
        except Exception:
            return False

    async def close(self) -> None:
        await self.client.close()

    async def generate(self, request_id: str, inputs: dict[str, Any]) -> AsyncIterator[Step]:
        """Responses of one generation until its final one. A replica that retired (its engine
        failed for good while the model's other replicas serve) refuses before any output: the
        request is sent once more, and Triton gives it to another replica."""
        for attempt in (1, 2):
            answered = False
            try:
                async with contextlib.aclosing(self._generate_once(request_id, inputs)) as steps:
                    async for step in steps:
                        answered = True
                        yield step
                return
            except GenerationError as e:
                if answered or attempt == 2 or not e.message.startswith(REPLICA_RETIRED):
                    raise

    async def _generate_once(self, request_id: str, inputs: dict[str, Any]) -> AsyncIterator[Step]:
        """Responses of one generation until its final one.

        Closing the iterator early (the HTTP client went away, the task was cancelled) cancels
        the gRPC stream: `llm` sees the request cancelled, aborts it and frees its KV blocks.
        Use it under `contextlib.aclosing` so that happens at once, not at garbage collection.
        """
        finished = asyncio.Event()
        request = {"model_name": self.model_name, "inputs": build_inputs(inputs), "request_id": request_id,
                   "parameters": CODED_ERRORS}

        async def requests():
            yield request
            await finished.wait()  # keep the stream open until the final response is in

        call = self.client.stream_infer(requests())
        complete = False
        try:
            async for result, error in call:
                if error is not None:
                    complete = True
                    code, message = split_error_code(error.message() or str(error))
                    raise GenerationError(message, code or _code_name(error.status()))
                step = parse_step(result)
                if step.final:
                    complete = True
                yield step
                if complete:
                    return
            raise GenerationError("unavailable: Triton closed the stream before the final response")
        except GenerationError:
            raise
        except grpc.aio.AioRpcError as e:  # Triton refused the request before llm saw it, or is gone
            complete = True
            raise GenerationError(e.details() or str(e), e.code().name) from None
        except Exception as e:  # the stream broken some other way
            raise GenerationError(f"unavailable: {type(e).__name__}: {e}") from None
        finally:
            finished.set()
            if not complete:
                # Also done by grpc when the task reading the stream is cancelled; explicit here
                # for every other way out (an exception, the consumer closing the iterator).
                call.cancel()
