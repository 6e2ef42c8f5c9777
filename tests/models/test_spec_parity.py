"""Greedy parity with HF transformers under speculative decoding, for every architecture, token
budget and block size of the parity suite and both CPU paths: n-gram proposals (prompts that
repeat themselves, so lookups find proposals) and a draft model (the checkpoint itself, whose
proposals are all accepted; another random checkpoint, whose proposals are all rejected and
rolled back). Proposals made and accepted are asserted, so a proposer that silently never
proposes fails."""

import json
import random

import pytest

from splitfuse import LLM, SamplingParams
from test_parity import _hf_reference, _max_tokens

# Builds engines for every case (make test-fast leaves it out; make test runs it).
pytestmark = pytest.mark.slow

ARCHS = ["llama", "mistral", "qwen2", "mixtral"]
SEGMENT_LENGTHS = [1, 3, 6, 11, 20]


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for n in SEGMENT_LENGTHS:
        segment = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append([1] + segment * 3 + segment[: n // 2])
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    prompts = _prompts(vocab)
    return request.param, path, prompts, _hf_reference(path, prompts)


def _run(path, prompts, **config):
    llm = LLM(path, dtype="float32", num_speculative_tokens=4, **config)
    engine = llm.engine
    params = [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    engine.check_invariants()
    assert engine.blocks.num_used_blocks == 0
    return [o.token_ids for o in outs], engine.speculation.num_proposed, engine.speculation.num_accepted


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("token_budget", [7, 64, 512])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_greedy_matches_hf(case, cpu_path, method, token_budget, block_size):
    name, path, prompts, refs = case
    spec = dict(speculative_method=method)
    if method == "draft":
        spec["speculative_model"] = path
    got, proposed, accepted = _run(path, prompts, token_budget=token_budget, block_size=block_size,
                                   **cpu_path, **spec)
    assert accepted > 0, f"{name}: {proposed} proposed, none accepted"
    if method == "draft":
        assert accepted == proposed, "the model drafting for itself must have every proposal accepted"
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"{name} {method} budget={token_budget} block={block_size} prompt#{i}"


def test_rejected_draft_proposals_roll_back(case, tiny_model_factory):
    """A different random checkpoint (a Llama, whatever the target) as draft: nearly every
    proposal rejected, its KV slots handed back, the output still HF's."""
    name, path, prompts, refs = case
    other = tiny_model_factory("llama", seed=11)
    got, proposed, accepted = _run(path, prompts, token_budget=64, block_size=4, speculative_method="draft",
                                   speculative_model=other)
    assert proposed > 0 and accepted < proposed
    assert got == refs, name


def test_speculation_with_tensor_parallel_ranks(case):
    """Speculation on a two-rank engine (verification rows travel with the step to the other
    rank; a draft model runs whole beside rank 0): still HF's tokens. n-gram for Llama and
    Qwen2, the model drafting for itself for Mistral and Mixtral (one two-rank engine each)."""
    name, path, prompts, refs = case
    spec = dict(speculative_method="ngram")
    if name in ("mistral", "mixtral"):
        spec = dict(speculative_method="draft", speculative_model=path)
    params = [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0) for i in range(len(prompts))]
    with LLM(path, dtype="float32", num_speculative_tokens=4, tensor_parallel_size=2, num_threads=2,
             token_budget=16, block_size=4, **spec) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_invariants()
        assert llm.engine.speculation.num_accepted > 0
    assert got == refs, name
