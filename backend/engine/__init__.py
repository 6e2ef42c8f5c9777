"""The engine core: requests become sequences, the scheduler decides each step's chunks within
the token budget, the block manager hands out KV blocks, the model runner executes the batch, the
sampler picks tokens, and `LLMEngine.step` ties one step together (`loop.EngineLoop` drives it
from a thread for servers, `splitfuse.llm.LLM` inline for offline use).

Nothing is imported here: `import splitfuse.engine.sequence` must not pull in torch."""
