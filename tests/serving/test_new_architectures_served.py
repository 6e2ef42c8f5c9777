"""The newer architectures served by a real tritonserver: for each, a tiny random-weight checkpoint
(built by its parity module in tests/models) behind one server of its own, and the greedy tokens
streamed over gRPC by the `llm` model equal transformers' generate(do_sample=False), stopping
where transformers stops. Another architecture joins by adding its builder to ARCHITECTURES
(one server start each)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from conftest import one_instance_server
from triton_helpers import grpc_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the parity modules' builders

pytestmark = pytest.mark.serving

# model_type -> (module in tests/models, its checkpoint builder, the builder's overrides or the
# name of one of the module's CASES)
ARCHITECTURES = {
    # Top-2 of 8 experts (weights not renormalised), layer 1 a dense MLP; with seed 3 the tokens of
    # PROMPTS change if the weights are renormalised.
    "qwen3_moe": ("test_qwen3_moe_parity", "build_qwen3_moe",
                  dict(seed=3, norm_topk_prob=False, mlp_only_layers=[1])),
    # Sliding (window 8, rope base 100) and global (linear x2) layers; prompts run past the window.
    "gemma3_text": ("test_gemma3_parity", "build_gemma3",
                    dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 50_000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # Phi-4-mini's shape: rope on 12 of 16 features, LongRoPE (the 41-token prompt is past its
    # switch at 32 positions, the others stay below it), tied embeddings.
    "phi3": ("test_phi3_parity", "build_phi3", "phi4-mini"),
}
PROMPTS = ([1, 7, 42, 300, 42, 300, 42], [1] + list(range(20, 60)), [1, 5], [1, 99, 98, 97, 96, 95, 94, 93, 92],
           [1, 250, 251] * 5)
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def served_arch(request, tmp_path_factory):
    """(architecture, transformers' greedy tokens per prompt, the running server)."""
    module_name, builder, overrides = ARCHITECTURES[request.param]
    module = importlib.import_module(module_name)
    build = getattr(module, builder)
    if isinstance(overrides, str):  # a case of the parity module's own
        overrides = module.CASES[overrides]
    model_dir = build(tmp_path_factory.mktemp(f"{request.param}-model"), **overrides)
    assert json.loads(Path(model_dir, "config.json").read_text())["model_type"] == request.param
    from test_parity import _hf_reference

    refs = _hf_reference(model_dir, list(PROMPTS), max_tokens=lambda i: MAX_TOKENS)
    with one_instance_server(model_dir, {}, tmp_path_factory.mktemp(f"{request.param}-triton")) as (_, server):
        yield request.param, refs, server


def test_streamed_greedy_tokens_match_transformers(served_arch):
    name, refs, server = served_arch
    for prompt, ref in zip(PROMPTS, refs):
        r = grpc_generate(server.grpc_url, "llm", {"input_ids": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                   "stream": True}, dtypes={"input_ids": "INT32"})
        assert r.error is None, f"{name}: {r.error}"
        assert r.output_ids == ref, f"{name}: prompt {prompt[:8]}"
        assert len(ref) < 2 or len(r.data) >= 2, f"{name}: the tokens came in one response, not streamed"
        assert r.finish_reason in ("stop", "length"), r.finish_reason
