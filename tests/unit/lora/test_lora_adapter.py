"""Reading PEFT LoRA folders: what is accepted, and bad folders refused at load with the file
and the problem named."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams
from splitfuse.lora.adapter import BaseShape, load_adapter
from splitfuse.models.args import ModelArgs
from splitfuse.models.loader import read_hf_config


def make_adapter(base: str, out_dir, seed: int = 0, **lora) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.setdefault("target_modules", ["q_proj", "v_proj"])
    get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora)).save_pretrained(str(out_dir))
    return str(out_dir)


def base_shape(path: str) -> BaseShape:
    a = ModelArgs.from_hf_config(read_hf_config(path))
    return BaseShape(num_layers=a.num_layers, hidden_size=a.hidden_size, q_size=a.num_heads * a.head_dim,
                     kv_size=a.num_kv_heads * a.head_dim, intermediate_size=a.intermediate_size)


@pytest.fixture(scope="module")
def good(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("good"), r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])


def _copy(src: str, tmp_path) -> str:
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(folder: str, **changes) -> None:
    path = f"{folder}/adapter_config.json"
    config = json.loads(open(path).read())
    config.update(changes)
    open(path, "w").write(json.dumps(config))


def test_good_adapter_is_fused_by_projection(tiny_llama, good):
    adapter = load_adapter("g", good, base_shape(tiny_llama), max_rank=64)
    assert adapter.targets == {"q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"} and adapter.rank == 8
    qkv = adapter.projections[(0, "qkv_proj")]
    shape = base_shape(tiny_llama)
    # q and v parts, k's columns left out; A side by side, B scaled by alpha / r = 2.
    assert [(p.out_start, p.out_end, p.rank_start, p.rank_end) for p in qkv.parts] == [
        (0, shape.q_size, 0, 4), (shape.q_size + shape.kv_size, shape.q_size + 2 * shape.kv_size, 4, 8)]
    tensors = load_file(f"{good}/adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    assert torch.equal(qkv.parts[1].b, (b * 2.0).t())
    assert adapter.projections[(1, "down_proj")].covers_output
    assert (0, "o_proj") not in adapter.projections


def test_rslora_scale(tiny_llama, tmp_path):
    folder = make_adapter(tiny_llama, tmp_path / "rs", r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj"])
    adapter = load_adapter("rs", folder, base_shape(tiny_llama), max_rank=64)
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    assert torch.allclose(adapter.projections[(1, "o_proj")].parts[0].b, (b * (8 / 4)).t())  # alpha / sqrt(16)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_file(tiny_llama, good, tmp_path, missing):
    folder = _copy(good, tmp_path)
    (tmp_path / "adapter" / missing).unlink()
    with pytest.raises(ValueError, match=f"{re.escape(missing)} not found"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)


def test_missing_folder(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter("x", tmp_path / "nowhere", base_shape(tiny_llama), 64)


def test_rank_above_max_lora_rank(tiny_llama, good):
    with pytest.raises(ValueError, match=r"adapter_config.json: rank 4 exceeds max_lora_rank=2"):
        load_adapter("x", good, base_shape(tiny_llama), max_rank=2)
    with pytest.raises(ValueError, match="max_lora_rank=2"):
        LLM(tiny_llama, lora_modules=f"x={good}", max_lora_rank=2, attention_backend="torch")


def test_embed_tokens_target_refused(tiny_llama, tmp_path):
    folder = make_adapter(tiny_llama, tmp_path / "emb", r=2, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"target_modules \['embed_tokens'\] are not supported"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)
    # A regex target_modules is not checked by name: the tensors are.
    _edit_config(folder, target_modules=".*(embed_tokens|q_proj)")
    with pytest.raises(ValueError, match="embed_tokens.*not a LoRA weight of q_proj"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)


def test_hidden_size_mismatch(tiny_llama, tiny_model_factory, tmp_path):
    other = tiny_model_factory("llama", hidden_size=32, intermediate_size=64)
    folder = make_adapter(other, tmp_path / "narrow", r=2)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: layer 0 q_proj: .*hidden size mismatch"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)


def test_layer_count_mismatch(tiny_llama, tiny_model_factory, tmp_path):
    deeper = tiny_model_factory("llama", num_hidden_layers=3)
    folder = make_adapter(deeper, tmp_path / "deep", r=2)
    with pytest.raises(ValueError, match=r"layer 2 q_proj: the base model has 2 layers"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)


@pytest.mark.parametrize("lora,message", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_unsupported_variants(tiny_llama, tmp_path, lora, message):
    folder = make_adapter(tiny_llama, tmp_path / "v", r=2, **lora)
    with pytest.raises(ValueError, match=f"adapter_config.json: .*{message}"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)


def test_missing_lora_b_and_rank_mismatch(tiny_llama, good, tmp_path):
    folder = _copy(good, tmp_path)
    weights = f"{folder}/adapter_model.safetensors"
    tensors = load_file(weights)
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="layer 1 up_proj: lora_B is missing"):
        load_adapter("x", folder, base_shape(tiny_llama), 64)
    other = _copy(good, tmp_path / "b")
    _edit_config(other, r=8)
    with pytest.raises(ValueError, match="rank 4 differs from adapter_config.json's r=8"):
        load_adapter("x", other, base_shape(tiny_llama), 64)


def test_bad_folder_fails_the_engine_start(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        LLM(tiny_llama, lora_modules=f"a={tmp_path}", attention_backend="torch")


def test_mlp_targets_refused_on_a_mixture_of_experts(tiny_llama, good):
    moe = dataclasses.replace(base_shape(tiny_llama), moe=True)
    with pytest.raises(ValueError, match="layer 0 down_proj: the base model's MLP is a mixture of experts"):
        load_adapter("x", good, moe, 64)


def test_adapter_changed_since_start_is_refused_at_reload(tiny_llama, good, tmp_path):
    """The prefix cache keys KV by adapter name, so an adapter evicted and read again must give the
    weights first read: a changed folder fails its requests with the reason, and the prefix chain
    of the old weights is never extended with new ones; an unchanged folder (even rewritten) and
    the other adapter serve on."""
    other = tmp_path / "other"
    shutil.copytree(good, other)
    llm = LLM(tiny_llama, lora_modules=f"good={good},other={other}", max_loras=1, attention_backend="torch",
              enable_prefix_caching=True, block_size=4)
    params = {n: SamplingParams(max_tokens=4, temperature=0.0, lora_name=n) for n in ("good", "other")}
    prompt = list(range(3, 20))
    first = llm.generate(prompt, params["other"])[0]
    llm.generate(prompt, params["good"])  # evicts "other"
    weights = other / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten, same content
    again = llm.generate(prompt, params["other"])[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens > 0
    llm.generate(prompt, params["good"])
    tensors = load_file(str(weights))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key] + 1.0
    save_file(tensors, str(weights), metadata={"format": "pt"})
    changed = llm.generate(prompt, params["other"])[0]
    assert changed.finish_reason == "error" and "changed since the engine started" in changed.error
    assert str(other) in changed.error
    assert llm.generate(prompt, params["good"])[0].finish_reason != "error"
    stats = llm.engine.lora_stats()
    assert stats.resident == ["good"]
    llm.engine.check_invariants()
