"""What pipeline parallelism serves beyond plain float checkpoints, with greedy tokens over two
stages equal to one stage's: a GGUF file (its weights dequantized, or its packed blocks kept as
they are) and a load quantization into blocks, each stage reading only its own layers' tensors;
static LoRA adapters, each stage keeping its own layers' weights; a draft model run whole on
rank 0. One two-rank engine per test, against a one-stage engine of the same config."""

import dataclasses
import json

import pytest

from splitfuse import LLMEngine, SamplingParams
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


def _adapter(base: str, folder) -> str:
    """A random PEFT adapter on every projection of every layer of `base`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(model, lora).save_pretrained(str(folder))
    return str(folder)


def _greedy_lora(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Each (prompt, adapter)'s greedy tokens, all added before the first step (one batch)."""
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(f"l{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0, lora_name=lora))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[f"l{i}"] for i in range(len(requests))]


@pytest.mark.slow  # starts a rank process
def test_two_stages_with_a_lora_adapter_match_one_stage(tiny_model_factory, tmp_path):
    """lora_modules over two stages: each stage keeps its own layers' adapter weights (keyed by
    their index in the stage); requests with the adapter and without, in the same steps, get one
    stage's greedy tokens."""
    path = tiny_model_factory("llama", num_hidden_layers=3)
    prompts = _prompts(path)
    requests = [(p, lora) for p in prompts for lora in ("a", None)]
    config = EngineConfig(model=path, lora_modules=f"a={_adapter(path, tmp_path / 'a')}", **ENGINE)
    engine = LLMEngine(dataclasses.replace(config, pipeline_parallel_size=2))
    try:
        # stage 0 holds layer 0 of 3: the adapter's weights of that layer only
        assert {layer for layer, _ in engine.runner.lora.stacks.projections} == {0}
        two = _greedy_lora(engine, requests)
    finally:
        engine.shutdown()
    assert not worker_pids()
    one = _greedy_lora(LLMEngine(dataclasses.replace(config, num_threads=1)), requests)
    assert two == one
    assert any(two[i] != two[i + 1] for i in range(0, len(requests), 2)), "the adapter was meant to change tokens"


@pytest.mark.slow  # starts a rank process
def test_two_stages_with_a_draft_model_match_one_stage(tiny_model_factory):
    """speculative_method=draft over two stages: the draft model runs whole on rank 0 (no rank
    group of its own, rank 0's share of the threads) and the pipeline verifies its proposals as
    it verifies n-gram ones; greedy tokens equal one stage's. The model drafts for itself, so
    every proposal is accepted and steps verify several tokens a sequence."""
    import torch

    path = tiny_model_factory("llama", num_hidden_layers=3)
    prompts = _prompts(path)
    config = EngineConfig(model=path, speculative_method="draft", speculative_model=path, num_speculative_tokens=3,
                          **ENGINE)
    engine = LLMEngine(dataclasses.replace(config, pipeline_parallel_size=2))
    try:
        draft = engine.speculation.proposer.runner
        assert draft.group is None and draft.leader is None and len(draft.model.model.layers) == 3
        assert len(worker_pids()) == 1 and torch.get_num_threads() == 1
        two = greedy(engine, prompts)
        proposed, accepted = engine.speculation.num_proposed, engine.speculation.num_accepted
    finally:
        engine.shutdown()
    assert not worker_pids()
    assert accepted == proposed > 0, (accepted, proposed)
    one = greedy(LLMEngine(dataclasses.replace(config, num_threads=1)), prompts)
    assert two == one
