"""splitfuse: a Dynamic SplitFuse LLM engine with a paged KV cache."""

from splitfuse.config import EngineConfig
from splitfuse.sequence import RequestOutput, SamplingParams

__all__ = ["EngineConfig", "RequestOutput", "SamplingParams"]
