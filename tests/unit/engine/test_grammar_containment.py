"""Grammar work is contained per request: a matcher that raises (filling its mask, or checking a
token sampled before masking), or one over the step budget (grammar_step_budget_ms), ends only
its request, with a clear error and its KV blocks freed; the other requests in the same steps
finish token for token as they do without it."""

from __future__ import annotations

import dataclasses

import pytest

from splitfuse import EngineConfig, SamplingParams
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.structured.guide import Guide
from splitfuse.structured.matcher import Matcher
from engine_runs import run_to_end

pytest.importorskip("xgrammar")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PLAIN = {"p0": "hello world", "p1": "the quick brown fox"}
GUIDE = Guide("regex", "[a-z ]{1,40}")


def config(model: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model, token_budget=32, block_size=4, max_model_len=256, num_kv_blocks=128,
                        attention_backend="torch", **overrides)


class BrokenMatcher(Matcher):
    """A real matcher whose grammar work raises once decoding starts."""

    def __init__(self, inner: Matcher) -> None:
        self.__dict__.update(inner.__dict__)

    def fill_(self, bitmask, row) -> None:
        raise RuntimeError("matcher broke filling")

    def allows(self, token: int) -> bool:
        raise RuntimeError("matcher broke checking")


def run(engine: LLMEngine, guided: SamplingParams | None, break_it: bool = False) -> dict:
    for rid, prompt in PLAIN.items():
        engine.add_request(rid, prompt, GREEDY)
    if guided is not None:
        engine.add_request("g", "say something", guided)
        if break_it:
            engine.masking.track("g", BrokenMatcher(engine.masking.get("g")))
    return run_to_end(engine)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    engine = LLMEngine(config(tiny_llama))
    try:
        return {rid: out.token_ids for rid, out in run(engine, None).items()}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("logprobs", [True, False], ids=["masked-before-sampling", "checked-after-sampling"])
def test_a_raising_matcher_ends_only_its_request(tiny_llama, expected, logprobs):
    engine = LLMEngine(config(tiny_llama))
    try:
        finals = run(engine, dataclasses.replace(GREEDY, guide=GUIDE, logprobs=logprobs), break_it=True)
        assert finals["g"].finish_reason == "error"
        assert "the request's grammar failed: RuntimeError: matcher broke" in finals["g"].error
        for rid in PLAIN:
            assert finals[rid].finish_reason == "length" and finals[rid].error is None
            assert finals[rid].token_ids == expected[rid]
        assert engine.blocks.num_used_blocks == 0 and engine.masking.get("g") is None
        engine.check_invariants()
    finally:
        engine.shutdown()


def test_grammar_work_over_the_step_budget_ends_only_its_request(tiny_llama, expected):
    engine = LLMEngine(config(tiny_llama, grammar_step_budget_ms=1e-6))  # any grammar work overruns it
    try:
        finals = run(engine, dataclasses.replace(GREEDY, guide=GUIDE, logprobs=True))
        assert finals["g"].finish_reason == "error"
        assert "over grammar_step_budget_ms (1e-06 ms)" in finals["g"].error
        for rid in PLAIN:
            assert finals[rid].token_ids == expected[rid]
        assert engine.blocks.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_a_guided_request_within_its_budget_finishes(tiny_llama):
    engine = LLMEngine(config(tiny_llama))
    try:
        finals = run(engine, dataclasses.replace(GREEDY, guide=GUIDE, logprobs=True))
        assert finals["g"].error is None and finals["g"].finish_reason in ("stop", "length")
    finally:
        engine.shutdown()
