"""The sparse MoE block (Mixtral) against a plain per-token reference, and its loading."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from splitfuse.kernels import silu_and_mul_reference
from splitfuse.layers.kernels import KernelSet
from splitfuse.layers.moe import SparseMoeBlock
from splitfuse.models.args import ModelArgs
from splitfuse.models.loader import load_model, read_hf_config

OPS = SimpleNamespace(silu_and_mul=silu_and_mul_reference)


def _block(hidden: int, inter: int, num_experts: int, top_k: int, seed: int = 0) -> SparseMoeBlock:
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(hidden, inter, num_experts, top_k, OPS)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
        block.experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2)
        block.experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=gen) * 0.2)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax over all experts, top-k, renormalise, weighted sum."""
    gate_up, down = block.experts.gate_up_proj.float(), block.experts.down_proj.float()
    inter = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = x[t].float()
        probs = torch.softmax(block.gate.weight.float() @ xt, dim=-1)
        top = torch.topk(probs, block.top_k)
        for p, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            g, u = (gate_up[e] @ xt).split(inter)
            out[t] += p * (down[e] @ (F.silu(g) * u))
    return out


def test_routes_tokens_to_different_experts_and_skips_unused_ones():
    hidden, inter, num_experts = 16, 24, 4
    block = _block(hidden, inter, num_experts, top_k=2)
    # The router reads only the first 4 features, one per expert, so each token's top-2
    # (and its unequal routing weights) are set by hand; expert 3 gets no token at all.
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :num_experts] = torch.eye(num_experts) * 4.0
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(1))
    scores = torch.tensor([[1.0, 0.3, 0.0, -2], [0.2, 1.5, 0.0, -2], [0.4, 0.0, 1.0, -2],
                           [0.9, 0.0, 1.1, -2], [0.0, 0.7, 0.2, -2], [0.1, 0.0, 0.8, -2]])
    x[:, :num_experts] = scores
    ids, weights = block.route(x)
    assert ids.tolist() == [[0, 1], [1, 0], [2, 0], [2, 0], [1, 2], [2, 0]]
    assert torch.bincount(ids.flatten(), minlength=num_experts).tolist() == [5, 3, 4, 0]
    assert torch.allclose(weights.sum(-1), torch.ones(6))
    assert (weights[:, 0] > weights[:, 1] + 0.05).all(), "weights should be unequal"
    torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 8, 2), (19, 4, 1), (11, 3, 3)])
def test_matches_per_token_reference(num_tokens, num_experts, top_k):
    block = _block(32, 48, num_experts, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-5, atol=1e-5)


def test_bfloat16_keeps_dtype():
    block = _block(32, 48, 4, 2)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    ref = _reference(block, x)
    block_bf16 = block.to(torch.bfloat16)
    out = block_bf16(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_bad_top_k_and_activation_are_rejected():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(16, 24, 4, 5, OPS)
    cfg = dict(model_type="mixtral", hidden_act="gelu", num_attention_heads=4, hidden_size=64, num_hidden_layers=2,
               intermediate_size=128, vocab_size=512, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArgs.from_hf_config(cfg)


def test_loads_classic_and_fused_expert_weights_alike(tiny_model_factory, tmp_path):
    """save_pretrained here writes per-expert w1/w2/w3 under `block_sparse_moe`; newer
    checkpoints store `mlp.experts.gate_up_proj` / `down_proj` stacked. Both must load alike."""
    path = tiny_model_factory("mixtral")
    cfg = read_hf_config(path)
    args = ModelArgs.from_hf_config(cfg)
    num_experts, inter = args.num_experts, args.intermediate_size
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        classic = {k: f.get_tensor(k) for k in f.keys()}
    assert any(".block_sparse_moe.experts.0.w1." in k for k in classic), sorted(classic)[:8]
    fused = {}
    for name, t in classic.items():
        if ".experts." not in name:
            fused[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer in range(args.num_layers):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([classic[f"{pre}.{j}.w1.weight"], classic[f"{pre}.{j}.w3.weight"]]) for j in range(num_experts)])
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [classic[f"{pre}.{j}.w2.weight"] for j in range(num_experts)])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(fused, str(tmp_path / "model.safetensors"))

    ops = KernelSet.create("torch")
    a = load_model(path, args, ops, torch.float32, torch.device("cpu"))
    b = load_model(tmp_path, args, ops, torch.float32, torch.device("cpu"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    # Spot-check the layout: expert 2's up rows are w3, its down matrix is w2.
    experts = a.model.layers[1].mlp.experts
    pre = "model.layers.1.block_sparse_moe.experts.2"
    assert torch.equal(experts.gate_up_proj[2, inter:], classic[f"{pre}.w3.weight"])
    assert torch.equal(experts.down_proj[2], classic[f"{pre}.w2.weight"])

    # A checkpoint missing one expert's weight is refused by name.
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tmp_path / "config.json", broken / "config.json")
    save_file({k: v for k, v in classic.items() if k != f"{pre}.w3.weight"}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_model(broken, args, ops, torch.float32, torch.device("cpu"))
