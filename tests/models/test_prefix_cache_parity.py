"""Greedy parity with HF transformers when requests share prefixes and the prefix cache serves
their KV: prefixes ending mid-block and exactly on a block boundary, a prompt submitted twice,
a second chat turn (turn 1's prompt + its output + new text), and a request admitted while
another with the same prefix is still being split; every token budget and block size of the
parity suite, both CPU paths, Llama and Mixtral. The cached-token counts are asserted too, so
a cache that silently never hits fails."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams

MAX_TOKENS = 8
BOUNDARY = 32  # a multiple of every block size tested
MID_BLOCK = 38  # inside a block for every block size tested


def _workload(vocab: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    shared = [1] + tokens(MID_BLOCK - 1)
    other = [1] + tokens(44)
    return {
        # wave 1
        "first": shared + tokens(9),
        # wave 2: looks up what wave 1 left in the cache
        "boundary": shared[:BOUNDARY] + tokens(11),
        "mid_block": shared + tokens(5),
        "again": None,  # = first, filled below: wholly cached but its last block
        "inflight_a": other + tokens(6),
        "inflight_b": other + tokens(3),  # may hit inflight_a's blocks while it is split
    }


def _hf_generate(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _cached(common: int, prompt_len: int, block_size: int) -> int:
    """Tokens a request hits when `common` of its leading tokens are cached in full blocks:
    whole blocks only, and always at least its last token left to compute."""
    return min(common // block_size, (prompt_len - 1) // block_size) * block_size


@pytest.fixture(scope="module")
def build_case(tiny_model_factory):
    built = {}

    def build(arch: str):
        if arch not in built:
            built[arch] = _build_case(tiny_model_factory, arch)
        return built[arch]

    return build


@pytest.fixture(params=["llama", "mixtral"])
def case(request, build_case):
    return build_case(request.param)


def _build_case(tiny_model_factory, arch: str):
    path = tiny_model_factory(arch)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    prompts = _workload(vocab)
    prompts["again"] = list(prompts["first"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = {name: _hf_generate(model, p) for name, p in prompts.items()}
    # Turn 2 of a chat: turn 1 (the first prompt) + its answer + a new user message.
    prompts["turn2"] = prompts["first"] + refs["first"] + [7, 11, 13, 17, 19]
    refs["turn2"] = _hf_generate(model, prompts["turn2"])
    return arch, path, prompts, refs


WAVES = [["first"], ["boundary", "mid_block", "again", "inflight_a", "inflight_b"], ["turn2"]]


def _run_waves(path, prompts, backends, **config) -> tuple[dict, dict, LLM]:
    llm = LLM(path, dtype="float32", **backends, **config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got, cached = {}, {}
    for wave in WAVES:
        outs = llm.generate([prompts[n] for n in wave], params)
        llm.engine.check_invariants()
        for name, out in zip(wave, outs):
            got[name], cached[name] = out.token_ids, out.num_cached_tokens
    assert llm.engine.blocks.num_used_blocks == 0
    return got, cached, llm


def _check(name, prompts, refs, got, cached, block_size, token_budget, caching=True):
    for n in refs:
        assert got[n] == refs[n], f"{name} budget={token_budget} block={block_size} {n} (caching={caching})"
    if not caching:
        assert all(v == 0 for v in cached.values()), cached
        return
    plen = {n: len(p) for n, p in prompts.items()}
    assert cached["first"] == 0
    assert cached["boundary"] == _cached(BOUNDARY, plen["boundary"], block_size)
    assert cached["mid_block"] == _cached(MID_BLOCK, plen["mid_block"], block_size)
    assert cached["again"] == _cached(plen["first"], plen["first"], block_size)
    # Turn 1 computed its prompt and all but its last generated token.
    assert cached["turn2"] == _cached(plen["first"] + MAX_TOKENS - 1, plen["turn2"], block_size)
    if token_budget == 7:
        # inflight_a is split over many steps, so inflight_b, admitted behind it, finds the
        # blocks its earlier chunks completed.
        assert cached["inflight_b"] > 0
    if token_budget == 512:
        assert cached["inflight_b"] == 0  # both admitted in one step: nothing computed yet


# Every budget x block size of the parity suite for Llama; Mixtral (whose MoE layer is what
# differs, not the cache) at the two extremes.
GRID = [("llama", b, s) for b in (7, 64, 512) for s in (4, 16)] + [("mixtral", 7, 4), ("mixtral", 512, 16)]


@pytest.mark.parametrize("arch,token_budget,block_size", GRID)
def test_prefix_cache_greedy_matches_hf(build_case, cpu_path, arch, token_budget, block_size):
    name, path, prompts, refs = build_case(arch)
    got, cached, llm = _run_waves(path, prompts, cpu_path, token_budget=token_budget, block_size=block_size)
    _check(name, prompts, refs, got, cached, block_size, token_budget)


def test_prefix_cache_off_matches_hf_and_never_hits(case, cpu_path):
    name, path, prompts, refs = case
    got, cached, _ = _run_waves(path, prompts, cpu_path, token_budget=64, block_size=16,
                                enable_prefix_caching=False)
    _check(name, prompts, refs, got, cached, 16, 64, caching=False)


def test_prefix_cache_parity_under_preemption(case, cpu_path):
    """A pool so small that cached blocks are evicted and sequences preempted; their
    recomputation hits the cache too."""
    name, path, prompts, refs = case
    llm = LLM(path, dtype="float32", **cpu_path, token_budget=16, block_size=4, num_kv_blocks=18,
              kv_watermark=0.0)
    engine = llm.engine
    names = [n for n in refs if n != "turn2"]
    for n in names:
        engine.add_request(n, prompts[n], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finals, hits = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        hits += engine.last_step.prefix_cache_hits
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert {n: finals[n].token_ids for n in names} == {n: refs[n] for n in names}, name
    first_admissions = sum(finals[n].num_cached_tokens for n in names)
    assert first_admissions > 0 and hits > first_admissions, "recomputed sequences were meant to hit the cache"
    assert engine.blocks.num_used_blocks == 0
