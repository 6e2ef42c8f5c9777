"""quantization="gguf" / "gguf-exact": the config's checks, and the loader's blocks read back
from the GGUF file a checkpoint was converted from (the trained SmolLM2 Q4_1 file, where its
package is installed) dequantizing to exactly the weights the float load reads from it, in
Hugging Face's row order (llama.cpp's rotary interleave of q and k undone) and stacked as the
fused projections stack them; and without the C++ kernels the float weights run."""

from __future__ import annotations

import pytest
import torch

from splitfuse.config import EngineConfig


@pytest.mark.parametrize("mode", ["gguf", "gguf-exact", "q4_0", "q4_1", "q8_0"])
def test_config_checks(mode):
    assert EngineConfig(model="m", quantization=mode).quantization == mode
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="m", quantization=mode, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="float32 activations"):
        EngineConfig(model="m", quantization=mode, dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="gguf4")


def test_blocks_read_back_equal_the_dequantized_weights(trained_model):
    from splitfuse.kernels.cpu import quant4
    from splitfuse.models.gguf_checkpoint import gguf_source

    source = gguf_source(trained_model)
    assert source is not None
    tensors = source.tensors()
    for names in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"],
                  ["self_attn.o_proj"], ["mlp.down_proj"]):
        hf = [f"model.layers.3.{n}.weight" for n in names]
        kind, rows = source.blocks(hf)
        assert kind == "Q4_1"
        assert torch.equal(quant4.dequantize(kind, rows), torch.cat([tensors.read(tensors.of(n), torch.float32)
                                                                    for n in hf]))
    assert source.blocks(["model.embed_tokens.weight"])[0] == "Q8_0"
    assert source.blocks(["model.norm.weight"]) is None  # F32: not a packed type


def test_no_source_for_a_plain_checkpoint(tiny_llama):
    from splitfuse.models.gguf_checkpoint import gguf_source

    assert gguf_source(tiny_llama) is None


@pytest.mark.slow  # a fresh process loading the 135M model
def test_without_the_cpp_kernels_the_float_weights_run(trained_model):
    """No compiler (or SPLITFUSE_CPU_KERNELS=0): the projections keep the dequantized float32
    weights and the torch path, with the reason logged, and answer as float32 does."""
    import os
    import subprocess
    import sys

    code = ("from splitfuse import LLM, SamplingParams; import sys\n"
            "for q in ('gguf', 'none'):\n"
            "    llm = LLM(sys.argv[1], quantization=q, enable_prefix_caching=False)\n"
            "    print(llm.engine.runner.weight_memory_summary(),\n"
            "          llm.generate([[1, 2, 3, 100]], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids)\n")
    run = subprocess.run([sys.executable, "-c", code, trained_model], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, SPLITFUSE_CPU_KERNELS="0"))
    assert run.returncode == 0, run.stderr[-2000:]
    gguf_line, none_line = run.stdout.strip().splitlines()[-2:]
    assert gguf_line == none_line and gguf_line.startswith("float32"), run.stdout
    assert "keeps the float kernel (the C++ CPU kernels are not built)" in run.stderr


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("tied", [False, True])
def test_embedding_on_the_files_blocks(tiny_model_factory, tmp_path, monkeypatch, quant, tied):
    """Under gguf-exact the embedding keeps the file's blocks of its table and widens the rows it
    looks up (the float32 table's values: the same logits as quantization none, bit for bit), and
    the float table is freed (a tied head multiplies the file's blocks too)."""
    pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import Q, write_gguf

    from splitfuse import LLM, SamplingParams
    from splitfuse.kernels.cpu import quant4

    if not quant4.available():
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    base = tiny_model_factory("llama", tie_word_embeddings=tied)
    model = str(write_gguf(base, tmp_path / "tiny.gguf", quant=Q[quant]))
    results = {}
    for mode in ("none", "gguf-exact"):
        with LLM(model, dtype="float32", quantization=mode, enable_prefix_caching=False) as llm:
            runner = llm.engine.runner
            logits = []
            collect = runner.collect
            runner.collect = lambda: logits.append(collect().clone()) or logits[-1]
            out = llm.generate([[1, 5, 9, 200, 17], [3] * 40], SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))
            embedding = runner.model.model.embed_tokens
            kind = (embedding.blocks[0] if embedding.blocks is not None
                    else embedding.head_blocks.kind if embedding.head_blocks is not None else None)
            results[mode] = (logits, [o.token_ids for o in out], runner.model.weight_memory(),
                             kind, embedding.weight.numel(), embedding.head_blocks is not None)
    plain, exact = results["none"], results["gguf-exact"]
    assert exact[3] == quant and exact[4] == 0
    assert plain[3] is None and plain[4] > 0
    # A tied head's packed blocks (gguf-exact: the float form, any kind) serve the lookups: the
    # table is held once.
    assert exact[5] == tied and not plain[5]
    vocab_bytes = plain[4] // 32 * quant4.BLOCK_BYTES[quant]
    assert exact[2][quant.lower()] >= vocab_bytes
    assert exact[2]["float32"] < plain[2]["float32"] - vocab_bytes  # the table is gone
    assert exact[1] == plain[1]
    assert len(exact[0]) == len(plain[0]) and all(torch.equal(a, b) for a, b in zip(exact[0], plain[0]))


@pytest.fixture(scope="module")
def converted_ggufs(tiny_model_factory, tmp_path_factory):
    """A tiny Llama written as a Q8_0 and as an F16 GGUF, each converted (config and tokenizer)."""
    from gguf import GGMLQuantizationType as Q

    from gguf_files import write_gguf
    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    root = tmp_path_factory.mktemp("auto-quantization")
    out = {}
    for quant in (Q.Q8_0, Q.F16):
        gguf_file = write_gguf(tiny_model_factory("llama"), root / f"tiny-{quant.name}.gguf", quant=quant)
        out[quant.name] = prepare_checkpoint(gguf_file, root / f"converted-{quant.name}")
    return out


def test_auto_runs_a_quantized_gguf_packed_and_everything_else_unquantized(converted_ggufs, tiny_llama, caplog):
    """quantization=auto: gguf for a quantized file where the block kernel runs; none for a float
    GGUF, a plain checkpoint, or where the kernel cannot run the blocks (the reason logged)."""
    from splitfuse.engine.quantization import resolve_quantization
    from splitfuse.kernels.cpu import quant4

    cpu = torch.device("cpu")
    q8, f16 = converted_ggufs["Q8_0"], converted_ggufs["F16"]
    assert EngineConfig(model="m").quantization == "auto"
    assert resolve_quantization(EngineConfig(model=q8), cpu) == ("gguf" if quant4.available() else "none")
    assert resolve_quantization(EngineConfig(model=f16), cpu) == "none"
    assert resolve_quantization(EngineConfig(model=tiny_llama), cpu) == "none"
    with caplog.at_level("WARNING", logger="splitfuse.engine.quantization"):
        assert resolve_quantization(EngineConfig(model=q8, dtype="bfloat16"), cpu) == "none"
        assert resolve_quantization(EngineConfig(model=q8, tensor_parallel_size=2), cpu) == "none"
        assert resolve_quantization(EngineConfig(model=q8), torch.device("meta")) == "none"
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 3 and all("dequantized at load" in r for r in reasons), reasons
    assert "dtype=bfloat16" in reasons[0] and "tensor parallelism" in reasons[1] and "for CPUs" in reasons[2]
    for explicit in ("none", "gguf-exact", "int8"):
        assert resolve_quantization(EngineConfig(model=q8, quantization=explicit), cpu) == explicit


def test_a_tied_table_is_held_once_under_gguf(tiny_model_factory, tmp_path, monkeypatch):
    """Under gguf a tied head runs the integer form (where the build has it) and its packed
    blocks serve the embedding's lookups too: the engine's weight bytes count the table once (the
    kernels' packed blocks and nothing else), the float table is freed, and a looked-up row is
    the file's row as the `gguf` package dequantizes it."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import Q, write_gguf

    from splitfuse import LLM
    from splitfuse.kernels.cpu import quant4
    from splitfuse.layers.linear import Linear

    if not quant4.available():
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_factory("llama", tie_word_embeddings=True), tmp_path / "tied.gguf", quant=Q.Q4_1)
    with LLM(str(path), dtype="float32", quantization="gguf", enable_prefix_caching=False) as llm:
        model = llm.engine.runner.model
        embedding, head = model.model.embed_tokens, model.lm_head.kernel
        assert head.packed.form == ("dot" if "Q4_1" in quant4.dot_kinds() else "float")
        assert embedding.head_blocks is head.packed and embedding.blocks is None
        assert embedding.weight.numel() == 0
        kernels = [m.kernel.weight_bytes.get("q4_1", 0) for m in model.modules() if isinstance(m, Linear)]
        assert model.weight_memory()["q4_1"] == sum(kernels)
        ids = torch.tensor([[0, 7, head.out_features - 1], [3, 3, 64]])
        table = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
        rows = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type))
        assert torch.equal(embedding(ids), rows[ids])
