"""What pipeline parallelism serves beyond plain float checkpoints, with greedy tokens over two
stages equal to one stage's: a GGUF file (its weights dequantized, or its packed blocks kept as
they are) and a load quantization into blocks; each stage reads only its own layers' tensors."""

import dataclasses
import json

import pytest

from splitfuse import LLMEngine
from splitfuse.config import EngineConfig
from splitfuse.kernels.cpu import quant4
from rank_processes import greedy, worker_pids

ENGINE = dict(dtype="float32", token_budget=12, block_size=4, num_kv_blocks=64, num_threads=2)


def _prompts(path: str) -> list[list[int]]:
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    return [[1, 5, 9], [1, 17, 30, 44, 2, 3], [1] + [(7 * i) % (vocab - 3) + 3 for i in range(30)]]


@pytest.fixture(scope="module")
def gguf_model(tiny_model_factory, tmp_path_factory) -> str:
    """A tiny three-layer Llama with a tied head (the last stage keeps the table for it) written
    as a Q8_0 GGUF file and converted."""
    pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import Q, write_gguf
    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    root = tmp_path_factory.mktemp("pp-gguf")
    base = tiny_model_factory("llama", num_hidden_layers=3, tie_word_embeddings=True)
    return prepare_checkpoint(write_gguf(base, root / "tiny.gguf", quant=Q.Q8_0), root / "converted")


@pytest.mark.slow  # starts a rank process per case
@pytest.mark.parametrize("source, quantization", [("gguf", "none"), ("gguf", "gguf"), ("safetensors", "q8_0")])
def test_two_stages_of_a_gguf_file_match_one_stage(gguf_model, tiny_model_factory, source, quantization):
    """quantization none: each stage dequantizes its own layers' tensors; gguf: each stage's
    projections multiply the file's Q8_0 blocks, kept packed (whole rows: a stage needs no cut);
    q8_0: each stage quantizes its own layers of a float checkpoint into blocks at load."""
    if quantization != "none" and not quant4.available():
        pytest.skip("the C++ CPU kernels are not built")
    path = gguf_model if source == "gguf" else tiny_model_factory("llama", num_hidden_layers=3,
                                                                  tie_word_embeddings=True)
    prompts = _prompts(path)
    config = EngineConfig(model=path, quantization=quantization, **ENGINE)
    engine = LLMEngine(dataclasses.replace(config, pipeline_parallel_size=2))
    try:
        model = engine.runner.model
        assert len(model.model.layers) == 1 and model.lm_head is None  # stage 0: layer 0 of 3
        packed = model.weight_memory().get("q8_0", 0)
        assert (packed > 0) == (quantization != "none"), model.weight_memory()
        two = greedy(engine, prompts)
    finally:
        engine.shutdown()
    assert not worker_pids()
    one = greedy(LLMEngine(dataclasses.replace(config, num_threads=1)), prompts)
    assert two == one
