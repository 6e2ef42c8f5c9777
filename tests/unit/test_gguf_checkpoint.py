"""GGUF checkpoints (models/gguf_checkpoint.py): a tiny Llama and Qwen2 written as GGUF here, with
quantized and float tensors and llama.cpp's q/k row order, convert into checkpoints whose greedy
tokens through our engine equal transformers' own GGUF loading of the same file; the conversion
is cached; bad files (not GGUF, cut short, another architecture, mixture-of-experts, a tensor
type that cannot be dequantized, two files in one folder) fail with errors that name the
problem, from the engine and from the launcher (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from splitfuse import LLM, SamplingParams  # noqa: E402
from splitfuse.models.gguf_checkpoint import GGUFError, convert, prepare_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what its converter writes for Llama)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: str, out: Path, *, arch: str | None = None, quant: Q = Q.Q8_0, expert_count: int = 0,
               tensor_type: dict[str, Q] | None = None) -> Path:
    """A GGUF file of `checkpoint` (a demo checkpoint) as llama.cpp's converter lays it out."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    tok = json.loads((Path(checkpoint) / "tokenizer.json").read_text())
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if expert_count:
        w.add_expert_count(expert_count)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in load_file(str(Path(checkpoint) / "model.safetensors")).items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{per_layer[rest]}"
        else:
            gname = names[name]
        data = t.float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute_rotary(data, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute_rotary(data, kv_heads)
        kind = (tensor_type or {}).get(gname, quant if data.ndim == 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(gname, data)
        elif kind == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, kind) if kind in gguf.quants._type_traits else data.astype(np.int8)
            w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _transformers_greedy(gguf_file: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    pytest.importorskip("accelerate", reason="transformers' GGUF model loading needs accelerate (dev extra)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch,quant", [("llama", Q.Q8_0), ("llama", Q.Q4_1), ("qwen2", Q.Q8_0), ("llama", Q.F16)])
def test_converted_gguf_matches_transformers_gguf_loading(tiny_model_factory, tmp_path, monkeypatch, arch, quant):
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    # hidden 64: rows of whole 32-element quantization blocks.
    gguf_file = write_gguf(tiny_model_factory(arch), tmp_path / f"tiny-{arch}.gguf", quant=quant)
    prompts = [[1, 5, 9, 200, 17, 33], [1] + list(range(40, 90))]
    want = _transformers_greedy(gguf_file, prompts, 10)
    with LLM(str(gguf_file), dtype="float32") as llm:
        got = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        converted = Path(llm.engine.config.model)
    assert [o.token_ids for o in got] == want
    assert converted.parent == tmp_path / "cache"
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["dtype"] == ("float16" if quant == Q.F16 else "float32")
    # Found again, not converted again; a folder holding the file names it too.
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert prepare_checkpoint(gguf_file) == str(converted) == prepare_checkpoint(tmp_path)
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_checkpoint_directory_passes_through(tiny_llama):
    assert prepare_checkpoint(tiny_llama) == tiny_llama


@pytest.mark.slow  # a launcher process per case
@pytest.mark.parametrize("case,message", [
    ("not-gguf", "is not a readable GGUF file"),
    ("truncated", "is not a readable GGUF file"),
    ("architecture", "architecture 'gpt2' is not supported (supported: llama, mistral, qwen2)"),
    ("moe", "a mixture-of-experts llama GGUF is not supported"),
    ("tensor-type", "tensor 'blk.0.ffn_up.weight' has type I8, which the gguf package cannot dequantize"),
])
def test_bad_files_fail_with_an_error_naming_the_problem(tiny_llama, tmp_path, case, message):
    path = tmp_path / "bad.gguf"
    if case == "not-gguf":
        path.write_bytes(b"this is not a model\n" * 50)
    elif case == "truncated":
        data = write_gguf(tiny_llama, tmp_path / "whole.gguf").read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif case == "architecture":
        write_gguf(tiny_llama, path, arch="gpt2")
    elif case == "moe":
        write_gguf(tiny_llama, path, expert_count=4)
    else:
        write_gguf(tiny_llama, path, tensor_type={"blk.0.ffn_up.weight": Q.I8})
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out-")] == []  # no half-written folder
    # The launcher says the same, as an error line and exit code 2 (no traceback).
    run = subprocess.run([sys.executable, "-m", "splitfuse.launcher", "--model", str(path), "--render-only",
                          "--model-repository-out", str(tmp_path / "repo")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPLITFUSE_GGUF_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and message in run.stderr, run.stderr[-2000:]


def test_two_gguf_files_in_one_folder_ask_which(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "a.gguf")
    write_gguf(tiny_llama, tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match="holds 2 .gguf files"):
        prepare_checkpoint(tmp_path)


@pytest.mark.slow  # the 135M-parameter model
def test_the_trained_models_conversion_equals_transformers_gguf_loading(trained_model):
    pytest.importorskip("accelerate", reason="transformers' GGUF model loading needs accelerate (dev extra)")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from splitfuse.launcher.default_model import packaged_gguf

    gguf_file = packaged_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32).state_dict()
    ours = load_file(str(Path(trained_model) / "model.safetensors"))
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
