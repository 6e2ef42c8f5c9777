"""`quantization=auto`, decided once the engine knows its checkpoint and device: a checkpoint
converted from a quantized GGUF file runs its blocks packed (`gguf`: llama.cpp's arithmetic, at
about the file's size in memory) wherever the packed kernel runs; anything else runs unquantized."""

from __future__ import annotations

import logging

import torch

from splitfuse.config import EngineConfig
from splitfuse.layers.q4_linear import q4_supported
from splitfuse.models.gguf_checkpoint import gguf_source

log = logging.getLogger(__name__)


def resolve_quantization(config: EngineConfig, device: torch.device) -> str:
    """The quantization this engine runs: `config.quantization`, or for `auto` the choice above,
    logged with its reason."""
    if config.quantization != "auto":
        return config.quantization
    source = gguf_source(config.model)
    if source is None or not source.quantized():
        return "none"
    why = ""
    if config.tensor_parallel_size > 1:
        why = "tensor parallelism shards float weights"
    elif config.dtype not in ("auto", "float32"):
        why = f"dtype={config.dtype} (the block kernel takes float32 activations)"
    else:
        ok, why = q4_supported(device, torch.float32)
    if why:
        log.warning("splitfuse: quantization=auto -> none: %s is quantized but its blocks cannot run packed here "
                    "(%s): its weights are dequantized at load, several times the file's size in memory",
                    source.file.name, why)
        return "none"
    log.info("splitfuse: quantization=auto -> gguf: %s's blocks multiply packed, activations in int8 per 32 values "
             "as llama.cpp's (gguf-exact: the dequantized model's results, slower; none: dequantize at load)",
             source.file.name)
    return "gguf"
