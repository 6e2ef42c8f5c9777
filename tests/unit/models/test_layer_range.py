"""What one pipeline stage holds of a model (models/layer_range.py): contiguous ranges covering
every layer once, the checkpoint names each stage reads (renamed to its local index) and skips,
and a model cut to its range on the meta device."""

import pytest
import torch

from splitfuse.layers.kernels import KernelSet
from splitfuse.models.args import ModelArgs
from splitfuse.models.layer_range import LayerRange, split_layers
from splitfuse.models.registry import causal_lm_class


@pytest.mark.parametrize("layers, stages", [(2, 2), (3, 2), (5, 2), (7, 3), (32, 4), (4, 1)])
def test_stages_cover_every_layer_once_in_order(layers, stages):
    ranges = split_layers(layers, stages)
    assert [r.first for r in ranges][0] == 0 and ranges[-1].end == layers
    assert all(a.end == b.first for a, b in zip(ranges, ranges[1:]))
    sizes = [r.end - r.first for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)
    assert [r.has_embedding for r in ranges] == [True] + [False] * (stages - 1)
    assert [r.has_head for r in ranges] == [False] * (stages - 1) + [True]


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        split_layers(2, 3)


def test_checkpoint_names_are_made_local_or_skipped():
    first, last = split_layers(5, 2)
    assert first.checkpoint_name("model.layers.1.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert first.checkpoint_name("model.layers.2.mlp.down_proj.weight") is None
    assert last.checkpoint_name("model.layers.2.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    assert last.checkpoint_name("model.layers.12.mlp.down_proj.weight") is None  # not "1" + "2"
    assert first.checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert last.checkpoint_name("model.embed_tokens.weight") is None
    for name in ("model.norm.weight", "lm_head.weight"):
        assert first.checkpoint_name(name) is None and last.checkpoint_name(name) == name
    tied_last = split_layers(5, 2, tie_word_embeddings=True)[1]
    assert tied_last.checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_a_model_cut_to_its_range_keeps_the_global_layer_indices():
    args = ModelArgs.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "sliding_window": 8,
        "layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]})
    assert args.sliding_windows == [None, None, 8, None]
    with torch.device("meta"):
        model = causal_lm_class(args)(args, KernelSet.create("torch", torch.float32))
    LayerRange(2, 4, 4).cut(model)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None]  # layers 2, 3
    assert model.model.embed_tokens is None and model.model.norm is not None and model.lm_head is not None
    assert sorted({name.split(".")[2] for name, _ in model.named_parameters() if ".layers." in name}) == ["0", "1"]
