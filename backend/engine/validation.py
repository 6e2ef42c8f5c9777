"""A request checked once, where it enters the engine (`LLMEngine.prepare_prompt`): its sampling
parameters, its adapter and its prompt (tokenized here). What passes is added as it is. A guide
is compiled later: by the server's loop after admission (EngineLoop), or when added directly
(`LLMEngine.add_request`, on the caller's thread)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from splitfuse.engine.sequence import SamplingParams
from splitfuse.inputs import PromptLimit


class RequestValidator:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, lora_names: Collection[str],
                 embeddings: bool = True) -> None:
        self.tokenizer = tokenizer
        self.embeddings = embeddings
        """Whether embedding requests are computed (not by a pipeline: its first stage has no hidden states to pool)."""
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prompt_limit = PromptLimit(tokenizer, max_model_len)
        self.lora_names = lora_names
        """Adapters requests may name; replaced whole when it changes (read on servers' threads)."""

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids; ValueError naming the field that is wrong. Thread-safe."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()  # again: a caller may have changed a field since it was built
        self.check_lora(params)
        token_ids = self._token_ids(prompt)
        if params.embed and not self.embeddings:
            raise ValueError("embed: embeddings are not computed with pipeline_parallel_size > 1")
        if params.embed:  # generates nothing: the prompt alone must fit
            if len(token_ids) > self.max_model_len:
                raise ValueError(f"prompt ({len(token_ids)} tokens) exceeds the model's context "
                                 f"(max_model_len={self.max_model_len})")
            return token_ids
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context (max_model_len={self.max_model_len})"
            )
        # (max_model_len is at most what the KV pool holds for one sequence, ModelRunner's
        # _fit_max_model_len: a request that passes fits the pool on its own, so preemption can
        # always make room for it.)
        return token_ids

    def check_lora(self, params: SamplingParams) -> None:
        names = self.lora_names
        if params.lora_name is not None and params.lora_name not in names:
            served = ", ".join(sorted(names))
            raise ValueError(f"unknown LoRA adapter {params.lora_name!r}; "
                             + (f"this engine serves: {served}" if served else "no LoRA adapters are configured"))

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.prompt_limit.check(prompt)
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids
