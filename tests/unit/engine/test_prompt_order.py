"""The prompt orders (prompt_order.py): the engine's measured rate, goodput's choice of prompts to
defer, and a burst of prompts scheduled under each order on a simulated clock."""

import itertools

import pytest

from splitfuse.engine.block_manager import BlockManager
from splitfuse.engine.prompt_order import PromptOrder
from splitfuse.engine.scheduler import Scheduler
from splitfuse.engine.sequence import SamplingParams, Sequence

_numbers = itertools.count(1)


def _prompt(length: int, at: float = 0.0) -> Sequence:
    n = next(_numbers)
    seq = Sequence(f"p{n}", list(range(1000 * n, 1000 * n + length)), SamplingParams(), arrival=n)
    seq.arrival_time = at
    return seq


def test_rate_is_measured_over_steps_of_half_the_budget_or_more():
    order = PromptOrder("goodput", 512.0, token_budget=256)
    order.record_step(100, 0.01)  # a light step: not measured
    assert order.tokens_per_s is None
    order.record_step(256, 0.1)
    assert order.tokens_per_s == pytest.approx(2560)
    order.record_step(128, 0.1)  # the average moves a quarter of the way
    assert order.tokens_per_s == pytest.approx(0.75 * 2560 + 0.25 * 1280)


def test_goodput_defers_the_fewest_prompts_to_meet_the_rest():
    """Eight prompts at once, 1,700 prompt tokens a second, deadlines at 512 tokens a second: in
    deadline order (shortest first here) the 4th is late and so is every later one; deferring
    the 386-, 600- and 747-token prompts lets the other five make theirs."""
    order = PromptOrder("goodput", 512.0, token_budget=256)
    prompts = [_prompt(n) for n in (747, 273, 600, 375, 376, 386, 517, 692)]
    assert order.defer_hopeless(prompts, now=0.0, prompt_tokens_per_s=1700.0)
    ranked = sorted(prompts, key=order.priority)
    assert [s.num_prompt_tokens for s in ranked] == [273, 375, 376, 517, 692, 386, 600, 747]
    finish = 0.0
    for seq in ranked[:5]:
        finish += seq.num_prompt_tokens / 1700.0
        assert finish <= order.deadline(seq)
    assert not order.defer_hopeless(prompts, now=0.0, prompt_tokens_per_s=1700.0)  # same choice
    assert order.defer_hopeless(prompts, now=0.0, prompt_tokens_per_s=1e9)  # all fit: none deferred
    assert [s.num_prompt_tokens for s in sorted(prompts, key=order.priority)] == sorted(
        s.num_prompt_tokens for s in prompts)


def test_a_late_prompt_is_deferred_until_twice_its_allowance():
    order = PromptOrder("goodput", 100.0, token_budget=64)
    late, fresh = _prompt(100, at=0.0), _prompt(100, at=1.5)  # due at 1 s and 2.5 s
    order.defer_hopeless([late, fresh], now=1.5, prompt_tokens_per_s=1000.0)
    assert sorted([late, fresh], key=order.priority) == [fresh, late]
    order.defer_hopeless([late, fresh], now=2.0, prompt_tokens_per_s=1000.0)  # waited 2 x 1 s
    assert sorted([late, fresh], key=order.priority) == [late, fresh]


def _burst(prompt_order: str) -> tuple[int, list[float]]:
    """A warm-up prompt, then eight at once; each step computes 8 tokens and takes 0.25 s of the
    clock (32 tokens a second); deadlines at 10 tokens a second. Returns how many of the eight had
    their first token by their deadline, and each one's time to first token."""
    sched = Scheduler(BlockManager(512, 4), token_budget=8, max_num_seqs=16, policy="splitfuse",
                      prompt_order=prompt_order, first_token_deadline_tokens_per_s=10.0)
    sched.add(_prompt(64, at=0.0))
    burst = [_prompt(n, at=2.0) for n in (74, 27, 60, 37, 37, 38, 51, 69)]
    first_token: dict[str, float] = {}
    for step in range(200):
        now = step * 0.25
        if now == 2.0:
            for seq in burst:
                sched.add(seq)
        out = sched.schedule(now)
        sampling = [c.seq for c in out.chunks if c.samples]
        sched.advance(out)
        sched.record_step(out.num_tokens, 0.25)
        for seq in sampling:
            seq.append_token(7)
            first_token[seq.request_id] = now + 0.25  # at the end of the step
            sched.finish(seq)
        if len(first_token) == 9:
            break
    assert len(first_token) == 9, "every prompt got its first token"
    on_time = sum(first_token[s.request_id] <= sched.prompt_order.deadline(s) for s in burst)
    return on_time, [first_token[s.request_id] - 2.0 for s in burst]


def test_goodput_meets_more_deadlines_in_a_burst_and_none_waits_past_twice_its_allowance():
    arrival, _ = _burst("arrival")
    deadline, _ = _burst("deadline")
    goodput, waits = _burst("goodput")
    assert goodput > max(arrival, deadline), (arrival, deadline, goodput)
    lengths = (74, 27, 60, 37, 37, 38, 51, 69)
    # A deferred prompt returns to deadline order at twice its allowance (length / 10 s), then
    # waits at most for the prompts ahead of it: all 393 tokens at 32 a second.
    assert all(w <= 2 * n / 10.0 + 393 / 32 for w, n in zip(waits, lengths))


def test_prompts_past_twice_their_allowance_are_never_deferred_and_others_make_room():
    """A prompt that has waited twice its allowance keeps its place; when it takes the time of
    those due after it, as many of them are deferred as needed for the rest to make theirs."""
    order = PromptOrder("goodput", 100.0, token_budget=64)
    old = _prompt(100, at=0.0)  # due at 1 s, protected from 2 s on
    a, b = _prompt(50, at=2.0), _prompt(60, at=2.0)  # due at 2.5 s and 2.6 s
    order.defer_hopeless([old, a, b], now=2.0, prompt_tokens_per_s=250.0)
    # old takes 0.4 s; a then ends at 2.6 s (late): deferring b alone leaves a late, so both go.
    assert sorted([old, a, b], key=order.priority) == [old, a, b]
    assert order.priority(a)[0] and order.priority(b)[0] and not order.priority(old)[0]
