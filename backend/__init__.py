"""splitfuse: a Dynamic SplitFuse LLM engine with a paged KV cache."""

from splitfuse.config import EngineConfig
from splitfuse.engine.sequence import RequestOutput, SamplingParams


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when the engine itself is asked for.
    if name == "LLM":
        from splitfuse.llm import LLM

        return LLM
    if name == "LLMEngine":
        from splitfuse.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
