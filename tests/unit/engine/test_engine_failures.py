"""Failures are contained: an exception tied to one request ends that request alone (error to
its caller, KV freed); a failing step ends the requests in flight; a broken engine fails every
pending and later request. Nothing waits forever.

Faults are injected by wrapping the real engine's parts (sampler, detokenizer, add, abort,
block pool) so that they raise for one chosen request or from a chosen moment on.
"""

from __future__ import annotations

import threading

import pytest

from splitfuse import LLM, EngineConfig, SamplingParams
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.loop import EngineLoop
from splitfuse.errors import EngineFailedError
from engine_runs import run_to_end

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = {"r0": "hello world", "r1": "the quick brown fox", "r2": "a lazy dog"}


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, token_budget=32, block_size=4, max_model_len=256, num_kv_blocks=128,
                        attention_backend="torch")


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """Greedy tokens of each prompt, run alone."""
    llm = LLM(tiny_llama, **{k: getattr(config(tiny_llama), k) for k in ("token_budget", "block_size",
                                                                        "num_kv_blocks", "attention_backend")})
    return {rid: llm.generate(p, GREEDY)[0].token_ids for rid, p in PROMPTS.items()}


class Injected(RuntimeError):
    pass


def raise_for(request_id: str, fn, seqs_of=lambda *a: ()):
    """fn, raising Injected when `request_id` is among the sequences seqs_of(args) names."""

    def wrapped(*args, **kwargs):
        if any(s.request_id == request_id for s in seqs_of(*args)):
            raise Injected(f"injected failure for {request_id}")
        return fn(*args, **kwargs)

    return wrapped


# ---- the engine: one request's failure ends it alone ----------------------------------------


def test_sampling_failure_of_one_request_fails_it_alone(tiny_llama, expected):
    engine = LLMEngine(config(tiny_llama))
    engine.sampler = raise_for("poison", engine.sampler, seqs_of=lambda logits, seqs: seqs)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.add_request("poison", "hello world", GREEDY)
    finals, generated = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        generated += engine.last_step.num_generated_tokens
    assert generated == len(PROMPTS) * GREEDY.max_tokens  # the failed request generated nothing
    bad = finals["poison"]
    assert bad.finish_reason == "error" and "Injected" in bad.error and "poison" in bad.error
    for rid in PROMPTS:
        assert finals[rid].finish_reason == "length" and finals[rid].error is None
        assert finals[rid].token_ids == expected[rid]
    assert engine.blocks.num_used_blocks == 0
    engine.check_invariants()


@pytest.mark.parametrize("when_finished", [False, True])
def test_detokenizer_failure_of_one_request_fails_it_alone(tiny_llama, expected, when_finished):
    """Its text step raises mid-stream, or only in the final step (after its KV was freed)."""
    engine = LLMEngine(config(tiny_llama))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.add_request("poison", "hello world", GREEDY)
    detok = engine._detokenizers["poison"]
    real_step = detok.step

    def step(ids, finished):
        if finished or not when_finished:
            raise Injected("injected detokenizer failure")
        return real_step(ids, finished)

    detok.step = step
    finals = run_to_end(engine)
    assert finals["poison"].finish_reason == "error" and "detokenizer" in finals["poison"].error
    if when_finished:
        assert len(finals["poison"].token_ids) == GREEDY.max_tokens
    for rid in PROMPTS:
        assert finals[rid].token_ids == expected[rid]
    assert engine.blocks.num_used_blocks == 0
    engine.check_invariants()


def test_add_that_raises_leaves_no_trace(tiny_llama):
    engine = LLMEngine(config(tiny_llama))
    real_add = engine.scheduler.add

    def add(seq):
        if seq.request_id == "poison":
            raise Injected("injected add failure")
        real_add(seq)

    engine.scheduler.add = add
    with pytest.raises(Injected):
        engine.add_request("poison", "hello", GREEDY)
    assert not engine.has_unfinished_requests()
    assert "poison" not in engine._detokenizers and not engine.scheduler.waiting
    engine.add_request("ok", "hello", GREEDY)
    assert run_to_end(engine)["ok"].finish_reason == "length"


# ---- EngineLoop: injected exceptions in add, abort and sampling ------------------------------


class Outputs:
    """Collects callback outputs; wait() until the given requests have finished."""

    def __init__(self) -> None:
        self.finals: dict[str, object] = {}
        self.deltas: dict[str, list] = {}
        self.cond = threading.Condition()

    def __call__(self, out) -> None:
        with self.cond:
            self.deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                self.finals[out.request_id] = out
                self.cond.notify_all()

    def wait(self, ids, timeout: float = 60.0) -> dict:
        with self.cond:
            assert self.cond.wait_for(lambda: all(i in self.finals for i in ids), timeout), (
                f"still waiting for {[i for i in ids if i not in self.finals]}")
            return {i: self.finals[i] for i in ids}


@pytest.fixture
def loop(tiny_llama):
    loop = EngineLoop(config(tiny_llama))
    loop.start()
    yield loop
    loop.shutdown(timeout=30)
    assert not loop._thread.is_alive()


def test_loop_survives_failing_add_abort_and_sampling(loop, expected):
    engine = loop.engine
    real_add, real_abort = engine.add_prepared, engine.abort_request

    def add(request_id, token_ids, params, **kwargs):
        if request_id == "bad-add":
            raise Injected("injected add failure")
        real_add(request_id, token_ids, params, **kwargs)

    def abort(request_id):
        if request_id == "bad-abort":
            raise Injected("injected abort failure")
        return real_abort(request_id)

    engine.add_prepared, engine.abort_request = add, abort
    engine.sampler = raise_for("bad-sample", engine.sampler, seqs_of=lambda logits, seqs: seqs)
    out = Outputs()
    for rid, prompt in PROMPTS.items():
        loop.submit(rid, prompt, GREEDY, out)
    loop.submit("bad-add", "hello", GREEDY, out)
    loop.submit("bad-sample", "hello", GREEDY, out)
    loop.submit("bad-abort", "hello", SamplingParams(max_tokens=200, ignore_eos=True), out)
    loop.abort("bad-abort")
    finals = out.wait([*PROMPTS, "bad-add", "bad-sample", "bad-abort"])
    assert finals["bad-add"].finish_reason == "error" and "add failed" in finals["bad-add"].error
    assert finals["bad-sample"].finish_reason == "error" and "Injected" in finals["bad-sample"].error
    # The abort raised; the request still ended (with an error) and its KV was freed.
    assert finals["bad-abort"].finish_reason == "error" and "abort failed" in finals["bad-abort"].error
    for rid in PROMPTS:
        assert finals[rid].finish_reason == "length" and finals[rid].token_ids == expected[rid]
    assert loop.failure is None
    loop.submit("after", PROMPTS["r0"], GREEDY, out)
    assert out.wait(["after"])["after"].token_ids == expected["r0"]
    assert engine.blocks.num_used_blocks == 0
    engine.check_invariants()


def test_failing_step_fails_requests_in_flight_then_loop_goes_on(loop, expected):
    runner = loop.engine.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def launch(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Injected("injected forward failure")
        return real_launch(batch)

    runner.launch = launch
    out = Outputs()
    for rid, prompt in PROMPTS.items():
        loop.submit(rid, prompt, GREEDY, out)
    finals = out.wait(list(PROMPTS))
    assert all(f.finish_reason == "error" and "engine step failed" in f.error for f in finals.values())
    assert loop.failure is None and loop.engine.blocks.num_used_blocks == 0
    loop.submit("after", PROMPTS["r1"], GREEDY, out)
    assert out.wait(["after"])["after"].token_ids == expected["r1"]


def test_broken_engine_fails_pending_and_later_requests(loop):
    """Freeing KV raises (the block pool can no longer be trusted): when the first request
    finishes, every request in flight ends with an error, later submits raise, the thread
    ends and shutdown does not hang."""

    def free(seq):
        raise Injected("injected block pool failure")

    loop.engine.blocks.free = free
    out = Outputs()
    params = {"r0": GREEDY, "r1": SamplingParams(max_tokens=40, ignore_eos=True),
              "r2": SamplingParams(max_tokens=40, ignore_eos=True)}
    for rid, prompt in PROMPTS.items():
        loop.submit(rid, prompt, params[rid], out)
    finals = out.wait(list(PROMPTS))
    for f in finals.values():
        assert f.finish_reason == "error" and "engine failed" in f.error and "block pool" in f.error
    assert loop.failure is not None and "block pool" in loop.failure
    with pytest.raises(EngineFailedError, match="block pool"):
        loop.submit("later", "hello", GREEDY, out)
    loop._thread.join(timeout=10)
    assert not loop._thread.is_alive()


def test_step_stats_count_preemptions(tiny_llama):
    """StepStats.num_preemptions (the splitfuse_preemptions_total metric) adds up to the
    scheduler's own count when the pool is too small for every sequence at once."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, token_budget=32, block_size=4, num_kv_blocks=24,
                                    kv_watermark=0.0, attention_backend="torch"))
    for i in range(4):
        engine.add_request(f"p{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    counted = 0
    while engine.has_unfinished_requests():
        engine.step()
        counted += engine.last_step.num_preemptions if engine.last_step else 0
    assert engine.scheduler.num_preemptions > 0 and counted == engine.scheduler.num_preemptions
