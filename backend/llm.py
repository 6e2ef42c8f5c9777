"""Offline API: `LLM(model, **engine_config).generate(prompts, params)`."""

from __future__ import annotations

from splitfuse.config import EngineConfig
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.sequence import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str, **config) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._next_id = 0

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks), if any."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs, in the order of `prompts`. All prompts are validated before any
        runs, so a bad one raises ValueError without starting the others."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        prepared = [self.engine.prepare_prompt(p, sp) for p, sp in zip(prompts, params)]
        ids = []
        for token_ids, sp in zip(prepared, params):
            request_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_prepared(request_id, token_ids, sp)
            ids.append(request_id)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]
