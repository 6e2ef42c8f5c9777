"""Sampling on the last pipeline stage (engine/stage_sampling.py): with pipeline_parallel_size=2
the last stage samples what rank 0 describes with each micro-batch and sends back tokens, not
logits. Every sampler feature gives the tokens one stage gives: seeded temperature / top-k /
top-p draws, repetition / presence / frequency penalties, min_tokens, log-probs and top
log-probs, and grammar-constrained rows (masked on the last stage with masks rank 0 filled),
alone and with n-gram speculation."""

from __future__ import annotations

import re

import pytest

from splitfuse import EngineConfig, SamplingParams
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.structured.guide import Guide

pytestmark = pytest.mark.slow  # starts a rank process

ENGINE = dict(dtype="float32", token_budget=16, block_size=4, num_kv_blocks=96, max_model_len=256,
              attention_backend="torch")
REGEX = "[a-z ]{1,30}"

REQUESTS = {
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
    "penalised": SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.4, ignore_eos=True),
    "presence": SamplingParams(max_tokens=10, temperature=1.1, presence_penalty=0.8, frequency_penalty=0.5,
                               seed=3, ignore_eos=True),
    "min_tokens": SamplingParams(max_tokens=8, min_tokens=6, temperature=0.7, seed=11),
    "logprobs": SamplingParams(max_tokens=8, temperature=0.9, seed=5, logprobs=True, top_logprobs=4,
                               ignore_eos=True),
    "guided": SamplingParams(max_tokens=12, temperature=0.0, guide=Guide("regex", REGEX)),
    "guided_sampled": SamplingParams(max_tokens=12, temperature=1.0, seed=9, logprobs=True,
                                     guide=Guide("regex", REGEX)),
}
PROMPTS = ["hello world", "the quick brown fox", "one two three four five six", "a b a b a b a b a b"]


def _run(engine: LLMEngine) -> dict:
    for i, (rid, params) in enumerate(REQUESTS.items()):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.blocks.num_used_blocks == 0
    return outs


@pytest.mark.parametrize("extra", [{}, dict(speculative_method="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_the_last_stage_samples_what_one_stage_samples(tiny_llama, extra):
    pytest.importorskip("xgrammar")
    one = _run(LLMEngine(EngineConfig(model=tiny_llama, num_threads=1, **ENGINE, **extra)))
    pp2 = LLMEngine(EngineConfig(model=tiny_llama, pipeline_parallel_size=2, num_threads=2, **ENGINE, **extra))
    widths: list[int] = []
    receive = pp2.runner.pipe.recv_sampled

    def recording(rows: int, width: int, device):
        widths.append(width)
        return receive(rows, width, device)

    pp2.runner.pipe.recv_sampled = recording
    try:
        two = _run(pp2)
        if not extra:
            _a_broken_grammar_ends_its_request_alone(pp2, two)
    finally:
        pp2.shutdown()
    assert set(two) == set(REQUESTS)
    for rid in REQUESTS:
        assert two[rid].error is None, two[rid].error
        assert two[rid].token_ids == one[rid].token_ids, rid
    for rid in ("logprobs", "guided_sampled"):
        assert two[rid].logprobs == pytest.approx(one[rid].logprobs, abs=1e-5), rid
    assert [[t for t, _ in top] for top in two["logprobs"].top_logprobs] == \
        [[t for t, _ in top] for top in one["logprobs"].top_logprobs]
    for rid in ("guided", "guided_sampled"):
        assert re.fullmatch(REGEX, two[rid].text), two[rid].text
    assert len(two["min_tokens"].token_ids) >= 6
    # Tokens crossed, not logits: token + log-prob + 4 top pairs per row at most.
    assert widths and max(widths) == 2 + 2 * 4 < pp2.vocab_size


def _a_broken_grammar_ends_its_request_alone(engine: LLMEngine, reference: dict) -> None:
    """A matcher that raises while rank 0 fills the masks ends its request with the grammar's
    error; the other requests of the same steps get the tokens they get without it."""
    engine.add_request("broken", "say something", REQUESTS["guided"])
    engine.masking.track("broken", _Broken(engine.masking.get("broken")))
    engine.add_request("greedy", PROMPTS[0], REQUESTS["greedy"])
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert "grammar failed" in outs["broken"].error
    assert outs["greedy"].token_ids == reference["greedy"].token_ids
    assert engine.blocks.num_used_blocks == 0


class _Broken:
    """A real matcher whose mask filling raises."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def fill_drafts_(self, *args):
        raise RuntimeError("matcher broke filling")
