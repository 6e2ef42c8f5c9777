"""gguf_gemma3: a gemma3 GGUF's names and its global layers' rope scaling, which transformers'
GGUF reader drops, put back into the config and read by ModelArgs; other kinds refused by name."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig

from splitfuse.models.args import ModelArgs
from splitfuse.models.gguf_gemma3 import configure_gemma3, gemma3_hf_name, is_shifted_norm


def test_norm_names_are_gemmas():
    assert gemma3_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert gemma3_hf_name("blk.0.post_attention_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gemma3_hf_name("blk.0.post_ffw_norm.weight") == "model.layers.0.post_feedforward_layernorm.weight"
    assert gemma3_hf_name("blk.0.attn_q.weight") is None  # the Llama names apply
    assert is_shifted_norm("blk.0.attn_k_norm.weight") and is_shifted_norm("output_norm.weight")
    assert not is_shifted_norm("blk.0.ffn_up.weight")


def test_linear_rope_scaling_reaches_the_global_layers_only():
    config = Gemma3TextConfig(num_hidden_layers=6, vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    meta = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    configure_gemma3(meta.get, config, "f.gguf")
    args = ModelArgs.from_hf_config(config.to_dict())
    assert (args.rope_scaling["rope_type"], args.rope_scaling["factor"], args.rope_theta) == ("linear", 8.0, 1e6)
    assert args.sliding_rope == (1e4, None)


def test_other_rope_scaling_is_refused_by_name():
    config = Gemma3TextConfig(num_hidden_layers=2)
    configure_gemma3({}.get, config, "f.gguf")  # none in the file: nothing changes
    assert config.rope_parameters["full_attention"]["rope_type"] == "default"
    with pytest.raises(ValueError, match="gemma3.rope.scaling.type = 'yarn'"):
        configure_gemma3({"gemma3.rope.scaling.type": "yarn"}.get, config, "f.gguf")
