"""The runner's rope tables for yarn, longrope and dynamic against transformers 5.24's own
ROPE_INIT_FUNCTIONS and rotary-embedding modules: identical inverse frequencies, attention
factors and cos/sin (float32, bit for bit)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from splitfuse.layers.rope_tables import build_rope_tables, longrope_parameters, yarn_parameters
from splitfuse.models.args import ModelArgs

SHAPE = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)
MAX_POSITIONS = 256

YARN = {
    "defaults": dict(factor=4.0),
    "betas-mscale": dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5),
    "attention-factor-no-truncate": dict(factor=3.0, attention_factor=1.25, truncate=False),
    "factor-from-context": dict(factor=None),
}


def _hf_tables(rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin [positions, rotary_dim / 2] (its tables repeat the half)."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _args(config) -> ModelArgs:
    return ModelArgs.from_hf_config(config.to_dict())


def _ours(args: ModelArgs, max_positions: int = MAX_POSITIONS):
    return build_rope_tables(args.rotary_dim or args.head_dim, args.rope_theta, args.rope_scaling, max_positions,
                             args.max_position_embeddings)


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_matches_transformers(name):
    rope = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=64) | YARN[name]
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=MAX_POSITIONS, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = _args(config)
    ours, our_factor = yarn_parameters(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
    assert torch.equal(ours, inv_freq) and our_factor == factor
    assert factor != 1.0  # the attention factor is applied, so the tables check it
    tables = _ours(args)
    cos, sin = _hf_tables(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config),
                          torch.arange(MAX_POSITIONS))
    assert tables.long_offset == 0 and torch.equal(tables.cos, cos) and torch.equal(tables.sin, sin)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_matches_transformers_on_both_sides_of_the_switch(partial):
    original, dim = 64, int(32 * partial)
    short = [1.0 + 0.05 * i for i in range(dim // 2)]
    long = [2.0 + 0.5 * i for i in range(dim // 2)]
    config = transformers.Phi3Config(**SHAPE, max_position_embeddings=MAX_POSITIONS,
                                     original_max_position_embeddings=original, partial_rotary_factor=partial,
                                     rope_scaling=dict(type="longrope", short_factor=short, long_factor=long))
    hf_short, factor = ROPE_INIT_FUNCTIONS["longrope"](config)
    hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=original + 1)
    args = _args(config)
    assert args.rotary_dim == dim
    ours_short, ours_long, our_factor = longrope_parameters(dim, args.rope_theta, args.rope_scaling,
                                                            args.max_position_embeddings)
    assert torch.equal(ours_short, hf_short) and torch.equal(ours_long, hf_long) and our_factor == factor > 1
    tables = _ours(args)
    assert tables.long_offset == MAX_POSITIONS and tables.cos.shape == (2 * MAX_POSITIONS, dim // 2)
    # transformers picks the set by the forward pass's length: up to `original`, short.
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    below = torch.arange(original)
    cos, sin = _hf_tables(rotary, below)
    assert torch.equal(tables.cos[below], cos) and torch.equal(tables.sin[below], sin)
    every = torch.arange(MAX_POSITIONS)
    cos, sin = _hf_tables(rotary, every)  # longer than `original`: long
    assert torch.equal(tables.cos[MAX_POSITIONS + every], cos) and torch.equal(tables.sin[MAX_POSITIONS + every], sin)
    # A sequence reads the long set when its prompt passes the switch.
    assert [tables.offset_for(n) for n in (1, original, original + 1)] == [0, 0, MAX_POSITIONS]


def test_dynamic_is_the_default_rope_within_max_position_embeddings_and_refused_beyond():
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=MAX_POSITIONS,
                                      rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0))
    args = _args(config)
    tables = _ours(args)
    cos, sin = _hf_tables(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config),
                          torch.arange(MAX_POSITIONS))
    assert torch.equal(tables.cos, cos) and torch.equal(tables.sin, sin)
    grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=2 * MAX_POSITIONS)
    default, _ = ROPE_INIT_FUNCTIONS["dynamic"](config)
    assert not torch.equal(grown, default)  # beyond, transformers changes them with the length
    with pytest.raises(NotImplementedError, match="rope type 'dynamic'"):
        _ours(args, 2 * MAX_POSITIONS)


def test_rope_types_we_do_not_run_are_refused_by_name():
    cfg = dict(model_type="llama", **SHAPE)
    with pytest.raises(ValueError, match="rope type 'proportional' is not supported"):
        ModelArgs.from_hf_config(cfg | dict(rope_parameters=dict(rope_type="proportional", rope_theta=1e4)))
