"""The `preprocessing` Triton model, tokenization for the ensemble: text_input -> input_ids,
input_lengths. model_repository/preprocessing/1/model.py imports it.

Runs in its own instances with dynamic batching, so the engine's thread never tokenizes
ensemble traffic, and queued requests are tokenized in one call of the fast tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from splitfuse.inputs import InputError, PromptLimit, has_chat_template, parse_messages, render_chat
from splitfuse.triton_server.request import InputBounds, check_bytes
from splitfuse.utils.orphan_guard import exit_with_parent


def _texts(request, bounds: InputBounds | None) -> list[str]:
    # Its element count Triton bounds (dims [1], batch <= max_batch_size); its bytes are bounded here.
    arr = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
    if bounds is not None:
        check_bytes("text_input", arr, bounds)
    out = []
    for value in arr.reshape(-1):
        try:
            text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as e:
            raise InputError(f"text_input is not valid UTF-8: {e}") from None
        if not text:
            raise InputError("text_input is empty")
        out.append(text)
    return out


def _error(message: str):
    return pb_utils.InferenceResponse(
        output_tensors=[], error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


def _flag(request, name: str) -> bool:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return bool(t is not None and t.as_numpy().any())


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        exit_with_parent()  # an orphaned stub ends at once (orphan_guard.py)
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer"])
        self.add_special_tokens = params.get("add_special_tokens", "true").strip().lower() in ("1", "true", "yes")
        self.pad_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0
        context = params.get("max_input_tokens", "").strip()
        self.limit = PromptLimit(self.tokenizer, int(context)) if context else None
        self.bounds = InputBounds.for_prompt_limit(self.limit, int(context)) if self.limit else None

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        # (request index, row texts, already templated) for the requests that parse.
        work: list[tuple[int, list[str], bool]] = []
        # Each request fails alone: a bad one gets its error, the rest of the batch goes on.
        for i, request in enumerate(requests):
            try:
                texts = _texts(request, self.bounds)
                chat = _flag(request, "apply_chat_template")
                if chat:
                    if not has_chat_template(self.tokenizer):
                        raise InputError("apply_chat_template: this tokenizer has no chat template")
                    texts = [render_chat(self.tokenizer, parse_messages(t, "text_input")) for t in texts]
                if self.limit is not None:
                    for t in texts:
                        self.limit.check(t, "text_input")
                work.append((i, texts, chat))
            except ValueError as e:  # InputError, and the limit's
                responses[i] = _error(str(e))

        # One tokenizer call per kind of text (plain / chat-templated, which carries its own
        # special tokens) across every request in the batch; if it fails, each request alone.
        for chat in (False, True):
            group = [(i, texts) for i, texts, c in work if c == chat]
            if not group:
                continue
            special = self.add_special_tokens and not chat
            try:
                encoded = self.tokenizer([t for _, texts in group for t in texts], add_special_tokens=special)
            except Exception:
                for i, texts in group:
                    try:
                        responses[i] = self._response(self.tokenizer(texts, add_special_tokens=special)["input_ids"])
                    except Exception as e:
                        responses[i] = _error(f"text_input could not be tokenized: {type(e).__name__}: {e}")
                continue
            pos = 0
            for i, texts in group:
                rows = encoded["input_ids"][pos:pos + len(texts)]
                pos += len(texts)
                responses[i] = self._response(rows)
        return responses

    def _response(self, rows: list[list[int]]):
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = r
        lengths = np.array([[len(r)] for r in rows], dtype=np.int32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_lengths", lengths),
        ])
