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

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from splitfuse import LLM, SamplingParams  # noqa: E402
from splitfuse.models.gguf_checkpoint import SUPPORTED_ARCHITECTURES, GGUFError, convert, prepare_checkpoint  # noqa: E402
from gguf_files import write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy")


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
    with LLM(str(gguf_file), dtype="float32", quantization="none") as llm:  # dequantized, as transformers
        got = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        converted = Path(llm.engine.config.model)
    assert [o.token_ids for o in got] == want
    assert converted.parent == tmp_path / "cache"
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["dtype"] == ("float16" if quant == Q.F16 else "float32")
    # No weights in the folder: the engine read them from the file.
    assert [p.name for p in converted.iterdir() if p.suffix in WEIGHT_SUFFIXES] == []
    # Found again, not converted again; a folder holding the file names it too.
    stamp = (converted / "config.json").stat().st_mtime_ns
    assert prepare_checkpoint(gguf_file) == str(converted) == prepare_checkpoint(tmp_path)
    assert (converted / "config.json").stat().st_mtime_ns == stamp


def test_a_folder_of_the_older_format_is_converted_again(tiny_llama, tmp_path):
    """A cache folder from the version that wrote the weights dequantized (its marker without a
    format) is replaced whole at the next start: config and tokenizer, no weights."""
    gguf_file = write_gguf(tiny_llama, tmp_path / "tiny.gguf")
    out = Path(prepare_checkpoint(gguf_file, tmp_path / "out"))
    marker = json.loads((out / "splitfuse_gguf.json").read_text())
    assert marker.pop("format") == 2
    (out / "splitfuse_gguf.json").write_text(json.dumps(marker))  # as the older version wrote it
    (out / "model.safetensors").write_bytes(b"old weights")
    assert prepare_checkpoint(gguf_file, out) == str(out)
    assert [p.name for p in out.iterdir() if p.suffix in WEIGHT_SUFFIXES] == []
    assert json.loads((out / "splitfuse_gguf.json").read_text())["format"] == 2


def test_a_checkpoint_directory_passes_through(tiny_llama):
    assert prepare_checkpoint(tiny_llama) == tiny_llama


@pytest.mark.slow  # a launcher process per case
@pytest.mark.parametrize("case,message", [
    ("not-gguf", "is not a readable GGUF file"),
    ("truncated", "is not a readable GGUF file"),
    ("architecture", f"architecture 'gpt2' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"),
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
def test_the_trained_models_tensors_equal_transformers_gguf_loading(trained_model):
    """Every tensor as the loader reads it from the file (dequantized alone, q/k rows in Hugging
    Face's order) equals transformers' own GGUF loading of the file."""
    pytest.importorskip("accelerate", reason="transformers' GGUF model loading needs accelerate (dev extra)")
    from transformers import AutoModelForCausalLM

    from splitfuse.models.gguf_checkpoint import gguf_source

    source = gguf_source(trained_model)
    reference = AutoModelForCausalLM.from_pretrained(source.file.parent, gguf_file=source.file.name,
                                                     dtype=torch.float32).state_dict()
    tensors = source.tensors()
    ours = {name: tensors.read(t, torch.float32) for name, t in tensors}
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
