"""Request priority (SamplingParams.priority, higher first): the scheduler admits waiting prompts by
priority and preempts the lowest-priority running sequence; the engine's greedy tokens do not
depend on it. Each ordering test runs with and without the priority, so it shows what changed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfuse import EngineConfig
from splitfuse.engine.block_manager import BlockManager
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.scheduler import Scheduler, SchedulerOutput
from splitfuse.engine.sequence import MAX_PRIORITY, SamplingParams, Sequence, SequenceStatus
from test_scheduler import Request, check_splitfuse, simulate


def _scheduler(budget: int, num_blocks: int = 256, order: str = "arrival") -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, watermark=0.0), token_budget=budget, max_num_seqs=64,
                     policy="splitfuse", prompt_order=order)


_arrivals = itertools.count(1)


def _add(sched: Scheduler, name: str, length: int, priority: int = 0) -> Sequence:
    arrival = next(_arrivals)
    first = 1000 * arrival  # no prompt a prefix of another
    seq = Sequence(name, list(range(first, first + length)), SamplingParams(priority=priority), arrival=arrival)
    sched.add(seq)
    return seq


def _step(sched: Scheduler) -> SchedulerOutput:
    """Run one step as the engine would: computed counts advance, sampling chunks get a token."""
    out = sched.schedule(now=0.0)
    sampling = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    for seq in sampling:
        seq.append_token(7)
    return out


def _ran(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in out.chunks]


def test_priority_is_bounded_and_named():
    assert SamplingParams(priority=MAX_PRIORITY).priority == MAX_PRIORITY
    assert SamplingParams(priority=-MAX_PRIORITY).priority == -MAX_PRIORITY
    for bad in (MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)


@pytest.mark.parametrize("order", ["arrival", "deadline", "goodput"])
@pytest.mark.parametrize("priority, first", [(0, "low1"), (5, "high")])
def test_a_high_priority_prompt_is_admitted_before_a_queue_of_low_ones(order, priority, first):
    """Prompts of one budget each: one runs a step, the others queue. A later prompt of higher
    priority goes ahead of the whole queue; of equal priority, it waits its turn."""
    sched = _scheduler(budget=16, order=order)
    for i in range(4):
        _add(sched, f"low{i}", 16)
    assert _ran(_step(sched)) == [("low0", 16)]
    _add(sched, "high", 16, priority)
    assert _ran(_step(sched)) == [("low0", 1), (first, 15)]  # low0's decode, then the next prompt
    if priority:
        assert [s.request_id for s in sched.waiting] == ["low1", "low2", "low3"]


@pytest.mark.parametrize("priority, expected", [(0, [("low", 16)]), (1, [("high", 8), ("low", 8)])])
def test_a_high_priority_prompt_goes_before_the_rest_of_a_low_one_being_split(priority, expected):
    sched = _scheduler(budget=16)
    _add(sched, "low", 40)
    assert _ran(_step(sched)) == [("low", 16)]
    _add(sched, "high", 8, priority)
    assert _ran(_step(sched)) == expected


@pytest.mark.parametrize("priority, victim", [(0, "high"), (1, "b")])
def test_under_kv_pressure_the_lowest_priority_newest_sequence_is_preempted(priority, victim):
    """Three one-block prompts in a four-block pool: after their first tokens each needs a second
    block and only one is free. Without priorities the newest (`high`) is preempted; with one,
    the newest of the lowest priority (`b`), though `high` arrived after it."""
    sched = _scheduler(budget=64, num_blocks=4)
    a, b = _add(sched, "a", 4), _add(sched, "b", 4)
    high = _add(sched, "high", 4, priority)
    assert len(_step(sched).chunks) == 3 and all(s.num_tokens == 5 for s in (a, b, high))
    out = _step(sched)
    assert [s.request_id for s in out.preempted] == [victim]
    assert sorted(c.seq.request_id for c in out.chunks) == sorted({"a", "b", "high"} - {victim})
    assert {s.request_id for s in sched.running} == {"a", "b", "high"} - {victim}
    assert sched.waiting[0].request_id == victim and sched.waiting[0].num_computed_tokens == 0


def check_priorities(sched, out, before, budget):
    """The queue is in priority order; a step's victims rank after every sequence left running;
    no prompt admitted this step has a lower priority than one left waiting."""
    queued = [s.params.priority for s in sched.waiting]
    assert queued == sorted(queued, reverse=True), "the queue is out of priority order"
    rank = lambda s: (-s.params.priority, s.arrival)  # noqa: E731
    for victim in out.preempted:
        assert all(rank(victim) > rank(s) for s in sched.running), "a higher-ranked sequence was preempted"
    admitted = [c.seq for c in out.chunks if before.get(id(c.seq), (SequenceStatus.WAITING,))[0]
                is SequenceStatus.WAITING]
    if admitted and sched.waiting:
        assert min(s.params.priority for s in admitted) >= max(queued), "a prompt admitted past a higher one"


requests_st = st.lists(
    st.builds(Request, prompt_len=st.integers(1, 60), output_len=st.integers(1, 20), arrive_step=st.integers(0, 20),
              abort_step=st.one_of(st.none(), st.integers(0, 40)), priority=st.integers(-2, 2)),
    min_size=1, max_size=20)


@settings(max_examples=80, deadline=None)
@given(requests=requests_st, policy=st.sampled_from(["splitfuse", "splitfuse", "prefill_first", "orca"]),
       budget=st.integers(1, 64), block_size=st.sampled_from([1, 4, 16]), extra_blocks=st.integers(0, 20),
       max_num_seqs=st.integers(1, 12), prompt_order=st.sampled_from(["arrival", "deadline", "goodput"]))
def test_priority_properties(requests, policy, budget, block_size, extra_blocks, max_num_seqs, prompt_order):
    """Mixed priorities under preemption, aborts and prefix caching: every request finishes, every
    block returns, slots hold their sequence's own tokens (simulate's checks), the SplitFuse
    properties hold, and priorities order the queue, the admissions and the victims."""
    if policy != "splitfuse" and prompt_order == "goodput":
        prompt_order = "deadline"

    def check(sched, out, before, budget):
        if policy == "splitfuse":
            check_splitfuse(sched, out, before, budget)
        check_priorities(sched, out, before, budget)

    simulate(requests, policy, budget, block_size, extra_blocks, max_num_seqs, check=check, prompt_order=prompt_order)


# ---- the engine ----------------------------------------------------------------------------


def _greedy_run(model: str, priorities: list[int]) -> tuple[dict[str, list[int]], list[str], list[str]]:
    """Requests r0, r1, ... added in order with `priorities` to an engine of its own whose pool, 24
    blocks of 4 tokens, holds fewer than half of the 60 blocks five requests of 8 + 40 tokens need,
    run to the end; (tokens by id, the order they finished in, the preempted ids step by step)."""
    engine = LLMEngine(EngineConfig(model=model, token_budget=16, block_size=4, num_kv_blocks=24,
                                    kv_watermark=0.0, attention_backend="torch"))
    for i, priority in enumerate(priorities):
        engine.add_request(f"r{i}", [1, 5 + i, 9, 13 + 2 * i, 4, 8, 15, 16 + i],
                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, priority=priority))
    finished, preempted, tokens = [], [], {}
    while engine.has_unfinished_requests():
        plan = engine.schedule()
        preempted += [s.request_id for s in plan.decision.preempted]
        for out in engine.execute(plan):
            if out.finished:
                finished.append(out.request_id)
                tokens[out.request_id] = out.token_ids
    engine.check_invariants()
    return tokens, finished, preempted


def test_greedy_tokens_do_not_depend_on_priority_and_the_high_one_is_never_preempted(tiny_llama):
    plain, plain_order, plain_victims = _greedy_run(tiny_llama, [0, 0, 0, 0, 0])
    prioritized, order, victims = _greedy_run(tiny_llama, [0, 0, 0, 0, 3])
    assert plain_victims and victims, "the pool was meant to be too small"
    assert prioritized == plain and all(len(t) == 40 for t in plain.values())
    assert "r4" in plain_victims and "r4" not in victims  # the newest, spared by its priority
    assert plain_order[-1] == "r4" and order[0] == "r4"


def test_the_engine_starts_a_high_priority_request_before_its_queue(tiny_llama):
    """A budget of one prompt a step and six queued: the high-priority request added last gets its
    first token right after the one running, before the other five."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, token_budget=8, block_size=4, num_kv_blocks=256,
                                    attention_backend="torch"))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"low{i}", [1, 20 + i, 3, 4, 5, 6, 7, 8], params)
    first_tokens = [o.request_id for o in engine.step() if o.is_first]
    engine.add_request("high", [1, 2, 3, 4, 5, 6, 7, 9],
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, priority=1))
    while engine.has_unfinished_requests():
        first_tokens += [o.request_id for o in engine.step() if o.is_first and o.delta_token_ids]
    assert first_tokens == ["low0", "high"] + [f"low{i}" for i in range(1, 6)]
