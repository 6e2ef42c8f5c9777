"""Guides compile after admission and off the engine thread (EngineLoop): a plain request is
never behind a compile, a request whose guide is compiling counts as waiting and can be aborted
(final "abort", nothing left), distinct guides waiting to compile are bounded
(max_pending_guides), and a compile past guide_compile_timeout_s fails with an error naming it.

The compiler is made slow with its test seam (a `_sleep` job queued in the real compiler
process ahead of the guide), as no guide compiles slowly for the tiny test tokenizer."""

from __future__ import annotations

import dataclasses
import queue
import time

import pytest

from splitfuse import EngineConfig, SamplingParams
from splitfuse.config import GrammarLimits
from splitfuse.engine.loop import EngineLoop
from splitfuse.errors import GUIDE_REFUSED
from splitfuse.errors import ServerBusyError
from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.guide import Guide

pytest.importorskip("xgrammar")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def guided(text: str) -> SamplingParams:
    return dataclasses.replace(GREEDY, guide=Guide("regex", text))


class Finals:
    """Collects each request's final output."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def callback(self, out) -> None:
        if out.finished:
            self.q.put(out)

    def get(self, timeout: float = 60.0):
        return self.q.get(timeout=timeout)


@pytest.fixture()
def loop(tiny_llama):
    config = EngineConfig(model=tiny_llama, token_budget=32, block_size=4, max_model_len=256, num_kv_blocks=128,
                          attention_backend="torch", max_pending_guides=2)
    lp = EngineLoop(config)
    lp.start()
    cache = lp.engine.grammars()
    cache._worker._child.test_seams = True  # before its first compile starts the child
    yield lp
    lp.shutdown(timeout=30)


def stall_compiler(loop: EngineLoop, seconds: float):
    """The compiler busy for `seconds` (guides queue behind); its future."""
    return loop.engine.grammars()._worker.submit("_sleep", str(seconds))


def test_a_plain_request_is_not_behind_a_compile_and_the_guided_one_follows(loop):
    stall = stall_compiler(loop, 6)
    finals = Finals()
    loop.submit("g", "say something", guided("[a-z]{1,5}"), finals.callback)
    assert loop.num_waiting >= 1  # admitted at once: it counts against max_waiting_requests
    start = time.monotonic()
    loop.submit("p", "hello world", GREEDY, finals.callback)
    first = finals.get()
    assert first.request_id == "p" and first.error is None
    assert not stall.done(), f"the plain request waited for the compiler ({time.monotonic() - start:.1f} s)"
    second = finals.get()
    assert second.request_id == "g" and second.error is None and second.finish_reason in ("stop", "length")
    assert loop.engine.blocks.num_used_blocks == 0


def test_aborting_a_request_whose_guide_compiles_ends_it_and_leaves_nothing(loop):
    stall = stall_compiler(loop, 3)
    finals = Finals()
    loop.submit("g", "say something", guided("[0-9]{2}"), finals.callback)
    loop.abort("g")
    out = finals.get()
    assert out.request_id == "g" and out.finish_reason == "abort"
    stall.result(timeout=60)
    time.sleep(1.0)  # the compile ends; the aborted request must not enter the engine
    assert not loop.engine.has_unfinished_requests() and loop.num_waiting == 0
    assert loop.engine.blocks.num_used_blocks == 0


def test_distinct_guides_waiting_to_compile_are_bounded(loop):
    stall_compiler(loop, 3)
    finals = Finals()
    loop.submit("a", "x", guided("[a-c]+"), finals.callback)
    loop.submit("b", "x", guided("[d-f]+"), finals.callback)
    loop.submit("a2", "x", guided("[a-c]+"), finals.callback)  # the same guide shares its compile
    with pytest.raises(ServerBusyError, match=r"guides are waiting to compile \(max_pending_guides=2\)"):
        loop.submit("c", "x", guided("[g-i]+"), finals.callback)
    assert sorted(finals.get().request_id for _ in range(3)) == ["a", "a2", "b"]


def test_a_guide_that_fails_ends_its_request_then_is_refused_at_submit(loop):
    finals = Finals()
    loop.submit("bad", "x", guided("(ab"), finals.callback)
    out = finals.get()
    assert out.finish_reason == "error" and out.error.startswith(GUIDE_REFUSED)
    with pytest.raises(ValueError):  # remembered: refused before anything is held
        loop.submit("bad2", "x", guided("(ab"), finals.callback)
    deadline = time.monotonic() + 10  # the engine thread settles its count after delivering
    while loop.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.num_waiting == 0


def test_a_compile_past_guide_compile_timeout_s_fails_naming_it(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    cache = GrammarCache(tokenizer, len(tokenizer), GrammarLimits(compile_timeout_s=1.5))
    cache._worker._child.test_seams = True
    slow = Guide("regex", "x")
    object.__setattr__(slow, "kind", "_sleep")  # the seam's kind, past Guide's own check
    object.__setattr__(slow, "text", "60")
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"took longer than guide_compile_timeout_s \(1.5 s\)"):
            cache.compile(slow)
        assert time.monotonic() - start < 30
        compiles = cache.num_compiles
        with pytest.raises(ValueError, match="guide_compile_timeout_s"):
            cache.compile(slow)  # remembered: not compiled again
        assert cache.num_compiles == compiles
        assert cache.compile(Guide("regex", "[0-9]+")) is not None  # a new compiler process serves on
    finally:
        cache.close()
