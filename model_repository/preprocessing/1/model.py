"""Tokenization for the ensemble: text_input -> input_ids, input_lengths.

Runs in its own instances with dynamic batching, so the engine's thread never tokenizes
ensemble traffic, and queued requests are tokenized in one call of the fast tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class InputError(ValueError):
    pass


def _texts(request) -> list[str]:
    arr = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
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


def _flag(request, name: str) -> bool:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return bool(t is not None and t.as_numpy().any())


def _messages(text: str) -> list[dict]:
    """A JSON list of {"role", "content"} messages, or plain text as one user message."""
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return [{"role": "user", "content": text}]
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"text_input looks like a JSON message list but does not parse: {e}") from None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ) or not messages:
        raise InputError('chat text_input must be a non-empty list of {"role": str, "content": str}')
    return messages


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer"])
        self.add_special_tokens = params.get("add_special_tokens", "true").strip().lower() in ("1", "true", "yes")
        self.pad_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        # (request index, row texts, already templated) for the requests that parse.
        work: list[tuple[int, list[str], bool]] = []
        for i, request in enumerate(requests):
            try:
                texts = _texts(request)
                chat = _flag(request, "apply_chat_template")
                if chat:
                    if self.tokenizer.chat_template is None:
                        raise InputError("apply_chat_template: this tokenizer has no chat template")
                    texts = [self.tokenizer.apply_chat_template(_messages(t), add_generation_prompt=True,
                                                                tokenize=False) for t in texts]
                work.append((i, texts, chat))
            except InputError as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses[i] = pb_utils.InferenceResponse(output_tensors=[], error=error)

        # One tokenizer call per kind of text (plain / chat-templated, which carries its own
        # special tokens) across every request in the batch.
        for chat in (False, True):
            group = [(i, texts) for i, texts, c in work if c == chat]
            if not group:
                continue
            flat = [t for _, texts in group for t in texts]
            encoded = self.tokenizer(flat, add_special_tokens=self.add_special_tokens and not chat)["input_ids"]
            pos = 0
            for i, texts in group:
                rows = encoded[pos:pos + len(texts)]
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
