"""`dtype=auto` on CPUs: a bfloat16 checkpoint runs in bfloat16 exactly where this CPU multiplies
bf16 natively (layers.linear.native_bf16_cpu: AVX-512 BF16 in the C++ kernels' build, or AMX),
float32 elsewhere (the forced-AVX2 sub-run of test_cpu_isa_variants covers the other answer);
float32 checkpoints stay float32; the choice is logged with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from splitfuse import LLM, SamplingParams
from splitfuse.layers.linear import native_bf16_cpu


def test_auto_dtype_follows_the_checkpoint_and_the_cpu(tiny_model_factory, caplog):
    caplog.set_level("INFO", logger="splitfuse.engine.model_runner")
    bf16 = tiny_model_factory("llama", dtype="bfloat16")
    assert json.loads((Path(bf16) / "config.json").read_text())["dtype"] == "bfloat16"
    native, why = native_bf16_cpu()
    with LLM(bf16, num_kv_blocks=32) as llm:
        assert llm.engine.runner.dtype == (torch.bfloat16 if native else torch.float32), why
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    assert any("dtype=auto -> " in r.getMessage() and why in r.getMessage() for r in caplog.records)
    with LLM(tiny_model_factory("llama"), num_kv_blocks=32) as llm:
        assert llm.engine.runner.dtype == torch.float32
