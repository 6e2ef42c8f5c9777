"""One Triton response of the `llm` model as named numpy arrays (TensorRT-LLM output names).

Pure numpy, like request parsing (request.py), so it is tested without a server; the
model's model.py wraps each array in a `pb_utils.Tensor`.
"""

from __future__ import annotations

import numpy as np

from splitfuse.engine.sequence import RequestOutput
from splitfuse.triton_server.request import Parsed


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def response_arrays(parsed: Parsed, out: RequestOutput, echo_prompt: str | None = None,
                    stop_handle: str | None = None) -> dict[str, np.ndarray]:
    """Outputs of one response: this step's delta when streaming, else everything so far.

    `echo_prompt` (exclude_input_in_output=false, first response only): the prompt's text,
    put before the text; its ids go before the ids. `stop_handle` (return_stop_handle, first
    response only): what a stop request must send to stop this generation.

    `log_probs` ([1, n]) and, with return_top_log_probs=k, `top_log_probs` / `top_log_prob_ids`
    ([1, n, k], most likely first) describe the n output tokens of the response only: an
    echoed prompt adds ids to `output_ids` but no rows to them.
    """
    if parsed.stream:
        text, ids, logprobs = out.delta_text, out.delta_token_ids, out.delta_logprobs
        top = out.delta_top_logprobs
    else:
        text, ids, logprobs = out.text, out.token_ids, out.logprobs
        top = out.top_logprobs
    if echo_prompt is not None:
        text = echo_prompt + text
        ids = list(out.prompt_token_ids) + list(ids)
    arrays = {
        "text_output": _text(text),
        "output_ids": np.array(ids, dtype=np.int32).reshape(1, -1),
        "finish_reason": _text(out.finish_reason or ""),
    }
    if parsed.return_num_input_tokens:
        arrays["num_input_tokens"] = np.array([[len(out.prompt_token_ids)]], np.int32)
    if parsed.return_num_output_tokens:
        arrays["num_output_tokens"] = np.array([[len(out.token_ids)]], np.int32)
    if parsed.return_num_cached_tokens:
        arrays["num_cached_tokens"] = np.array([[out.num_cached_tokens]], np.int32)
    if parsed.return_log_probs:
        arrays["log_probs"] = np.array(logprobs or [], np.float32).reshape(1, -1)
    if parsed.return_top_log_probs:
        top = top or []
        # Fewer than k per token only when the vocabulary is smaller than k.
        k = len(top[0]) if top else parsed.return_top_log_probs
        arrays["top_log_probs"] = np.array([[lp for _, lp in row] for row in top], np.float32).reshape(1, -1, k)
        arrays["top_log_prob_ids"] = np.array([[t for t, _ in row] for row in top], np.int32).reshape(1, -1, k)
    if stop_handle is not None:
        arrays["stop_handle"] = _text(stop_handle)
    if out.embedding is not None:  # embeddings_only: the final (only) response
        arrays["embeddings"] = np.asarray(out.embedding, np.float32).reshape(1, -1)
    return arrays


def stop_ack_arrays() -> dict[str, np.ndarray]:
    """The answer to a `stop` request (the stopped generation ends with "abort" on its own stream)."""
    return {"text_output": _text(""), "finish_reason": _text("abort")}


def lora_ack_arrays(message: str) -> dict[str, np.ndarray]:
    """The answer to a run-time LoRA load or unload that succeeded."""
    return {"text_output": _text(message), "finish_reason": _text("stop")}
