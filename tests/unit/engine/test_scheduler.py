"""Property tests of the scheduler + block manager, driven without a model.

A simulated step "executes" what the scheduler chose: computed counts advance and a chunk
that reaches its sequence's end appends a token. Requests finish after their own number of
output tokens, some are aborted midway, and the KV pool is often far too small for the load.
"""

import itertools
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from splitfuse.engine.block_manager import BlockManager, blocks_needed
from splitfuse.engine.scheduler import Scheduler
from splitfuse.engine.sequence import Sequence, SamplingParams, SequenceStatus


@dataclass
class Request:
    prompt_len: int
    output_len: int
    arrive_step: int
    abort_step: int | None
    priority: int = 0


requests_st = st.lists(
    st.builds(
        Request,
        prompt_len=st.integers(1, 80),
        output_len=st.integers(1, 24),
        arrive_step=st.integers(0, 30),
        abort_step=st.one_of(st.none(), st.integers(0, 60)),
    ),
    min_size=1,
    max_size=24,
)


def simulate(requests, policy, budget, block_size, extra_blocks, max_num_seqs, watermark=0.0, check=None,
             prompts=None, prefix_caching=True, speculation=None, prompt_order="arrival"):
    """Run `requests` to completion. Prompts default to one shared run of ids (every prompt a
    prefix of the longest), so the prefix cache is exercised hard. A fake KV pool records
    which token each slot holds: every chunk must find its sequence's own tokens in the
    slots before it, and must never write into a block another sequence holds.

    `speculation` = (k, disable_batch_size, seed): decoding sequences get up to k proposals,
    each right (the simulated model always samples 7) or wrong at random; the accepted ones
    are appended and the rest rolled back, as the engine does.

    `prompt_order`: as the engine's (deadlines at 4 tokens a step), the clock being the step
    number."""
    # The pool always fits the largest request alone (the engine rejects others at add time).
    largest = max(blocks_needed(r.prompt_len + r.output_len, block_size) for r in requests)
    total = int((largest + extra_blocks) / (1.0 - watermark)) + 1
    blocks = BlockManager(total, block_size, watermark, enable_prefix_caching=prefix_caching)
    assert total - blocks.watermark_blocks >= largest
    k, disable_batch, seed = speculation or (0, 0, 0)
    sched = Scheduler(blocks, budget, max_num_seqs, policy, disable_batch, prompt_order=prompt_order,
                      first_token_deadline_tokens_per_s=4.0)
    rng = random.Random(seed)
    if prompts is None:
        prompts = [list(range(3, 3 + r.prompt_len)) for r in requests]
    seqs = [
        Sequence(f"r{i}", prompts[i], SamplingParams(max_tokens=r.output_len, priority=r.priority), arrival=i)
        for i, r in enumerate(requests)
    ]
    slots: list[list[int | None]] = [[None] * block_size for _ in range(total)]
    keys: dict[int, list[int]] = {}
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrive_step)
    live: dict[int, Sequence] = {}
    finished: set[int] = set()
    step = 0
    max_steps = 20 * sum(r.prompt_len + r.output_len for r in requests) + 200
    while pending or live:
        assert step < max_steps, "no progress: scheduler stalled"
        while pending and requests[pending[0]].arrive_step <= step:
            i = pending.pop(0)
            live[i] = seqs[i]
            seqs[i].arrival_time = float(step)
            sched.add(seqs[i])
        for i in list(live):
            if requests[i].abort_step == step:
                sched.finish(live.pop(i))
                finished.add(i)
        for s in live.values():
            s.draft_token_ids = [rng.choice([7, 7, 8]) for _ in range(rng.randint(0, k))] if k else []
        before = {id(s): (s.status, s.num_uncomputed_tokens) for s in live.values()}
        out = sched.schedule(now=float(step))
        if check is not None:
            check(sched, out, before, budget)
        for c in out.chunks:
            run_on_fake_kv(c, slots, block_size, live.values(), keys)
        sampling = [c for c in out.chunks if c.samples]
        sched.advance(out)
        sched.record_step(out.num_tokens, 1.0)
        for c in sampling:
            drafts = c.seq.draft_token_ids[: c.num_draft_tokens]
            accepted = next((i for i, t in enumerate(drafts) if t != 7), len(drafts))
            left = requests[int(c.seq.request_id[1:])].output_len - c.seq.num_output_tokens
            for _ in range(min(accepted + 1, left)):
                c.seq.append_token(7)
            if c.num_draft_tokens and accepted + 1 < left:
                sched.accept_drafts(c.seq, accepted)
        for i, s in list(live.items()):
            if s.num_output_tokens >= requests[i].output_len:
                sched.finish(s)
                del live[i]
                finished.add(i)
        blocks.check_invariants(list(live.values()))
        for s in live.values():  # no block kept past what the tokens need (rejected proposals' returned)
            assert len(s.block_table) <= blocks_needed(s.num_tokens, block_size), s.request_id
        step += 1
    assert finished == set(range(len(requests))), "every request finishes"
    assert blocks.num_free_blocks == blocks.num_blocks, "all blocks returned"
    return sched


def run_on_fake_kv(chunk, slots, block_size, live, keys) -> None:
    """What a forward pass does with the KV pool: read the context, write the chunk's tokens.
    A slot holds a key of the whole prefix up to its token (KV depends on all of it)."""
    seq, start = chunk.seq, chunk.seq.num_computed_tokens
    seq_keys = keys.setdefault(id(seq), [])
    while len(seq_keys) < start + chunk.num_tokens:
        seq_keys.append(hash((seq_keys[-1] if seq_keys else None, seq.token_ids[len(seq_keys)])))
    # Proposed tokens after the chunk: keys of the prefix they would make (a rejected one's slot
    # holds a key no accepted prefix has, and must be rewritten before anything reads it).
    run_keys = seq_keys[: start + chunk.num_tokens]
    for token in seq.draft_token_ids[: chunk.num_draft_tokens]:
        run_keys = run_keys + [hash((run_keys[-1], token))]
    table = seq.block_table
    for pos in range(start):
        assert slots[table[pos // block_size]][pos % block_size] == seq_keys[pos], (
            f"{seq.request_id}: the KV slot of position {pos} was computed for another prefix"
        )
    others = {b for s in live if s is not seq for b in s.block_table}
    for pos in range(start, start + chunk.num_tokens + chunk.num_draft_tokens):
        block = table[pos // block_size]
        assert block not in others, f"{seq.request_id} writes into block {block} that another sequence holds"
        slots[block][pos % block_size] = run_keys[pos]


def check_splitfuse(sched, out, before, budget):
    n = out.num_tokens
    assert n <= budget, "budget exceeded"
    scheduled = {id(c.seq): c.num_tokens for c in out.chunks}
    assert len(scheduled) == len(out.chunks), "a sequence scheduled twice in one step"
    # Decodes first: running sequences with one token to compute precede all prompt chunks,
    # and no prompt chunk runs while such a decode is left out.
    kinds = [before.get(id(c.seq), (None, None)) == (SequenceStatus.RUNNING, 1) for c in out.chunks]
    assert kinds == sorted(kinds, reverse=True), "a prompt chunk was scheduled before a decode"
    unscheduled_decodes = [
        key for key, (status, left) in before.items()
        if status is SequenceStatus.RUNNING and left == 1 and key not in scheduled
        and key not in {id(s) for s in out.preempted}
    ]
    if unscheduled_decodes:
        assert n == budget and all(kinds), "decodes left out while prompts ran or budget unused"
    # Filled exactly whenever enough work waits: an unfilled budget means every running
    # sequence got all its tokens and the head of the queue could not be admitted (or the
    # step preempted: then nothing is admitted, so the freed blocks are not taken back at once).
    if n < budget:
        for s in sched.running:
            assert scheduled.get(id(s), 0) == s.num_uncomputed_tokens, "runnable work left with budget unused"
        if sched.waiting and not out.preempted:
            head = sched.waiting[0]
            assert len(sched.running) >= sched.max_num_seqs or not sched.blocks.can_admit(head, head.num_tokens)
    order = sched.prompt_order
    if order.by_deadline:
        # Prompt chunks by key (request priority, deferred last, then earliest deadline), being
        # split or new; the queue in that order.
        due = [sched._prompt_key(c.seq) for c, decode in zip(out.chunks, kinds) if not decode]
        assert due == sorted(due), "a prompt ran before one of higher priority"
        queued = [sched._prompt_key(s) for s in sched.waiting]
        assert queued == sorted(queued), "the queue is out of priority order"


@settings(max_examples=150, deadline=None)
@given(
    requests=requests_st,
    budget=st.integers(1, 96),
    block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(1, 16),
    prompt_order=st.sampled_from(["arrival", "arrival", "deadline", "goodput"]),
)
def test_splitfuse_properties(requests, budget, block_size, extra_blocks, max_num_seqs, prompt_order):
    simulate(requests, "splitfuse", budget, block_size, extra_blocks, max_num_seqs, check=check_splitfuse,
             prompt_order=prompt_order)


@settings(max_examples=60, deadline=None)
@given(
    requests=requests_st,
    policy=st.sampled_from(["prefill_first", "orca"]),
    budget=st.integers(1, 96),
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 40),
    prompt_order=st.sampled_from(["arrival", "deadline"]),
)
def test_baseline_policies_finish_and_conserve_blocks(requests, policy, budget, block_size, extra_blocks,
                                                      prompt_order):
    simulate(requests, policy, budget, block_size, extra_blocks, max_num_seqs=8, prompt_order=prompt_order)


@settings(max_examples=60, deadline=None)
@given(requests=requests_st, budget=st.integers(4, 64), watermark=st.sampled_from([0.01, 0.1, 0.3]))
def test_watermark_never_deadlocks(requests, budget, watermark):
    simulate(requests, "splitfuse", budget, 4, extra_blocks=2, max_num_seqs=16, watermark=watermark,
             check=check_splitfuse)


def test_tiny_pool_forces_preemption_and_still_finishes():
    # Eight long generations share a pool that holds barely more than one of them.
    requests = [Request(prompt_len=10, output_len=30, arrive_step=0, abort_step=None) for _ in range(8)]
    sched = simulate(requests, "splitfuse", budget=16, block_size=4, extra_blocks=3, max_num_seqs=8,
                     check=check_splitfuse)
    assert sched.num_preemptions > 0


def test_long_prompt_is_split_and_only_last_chunk_samples():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, token_budget=10, max_num_seqs=4, policy="splitfuse")
    seq = Sequence("a", list(range(25)), SamplingParams(), arrival=0)
    sched.add(seq)
    sizes, samples = [], []
    while seq.num_output_tokens == 0:
        out = sched.schedule()
        (chunk,) = out.chunks
        sizes.append(chunk.num_tokens)
        samples.append(chunk.samples)
        seq.num_computed_tokens += chunk.num_tokens
        if samples[-1]:
            seq.append_token(1)
    assert sizes == [10, 10, 5]
    assert samples == [False, False, True]


def test_short_prompts_fused_and_last_cut_to_fill_budget():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, token_budget=16, max_num_seqs=8, policy="splitfuse")
    for i, n in enumerate([5, 6, 9]):
        sched.add(Sequence(f"s{i}", list(range(n)), SamplingParams(), arrival=i))
    out = sched.schedule()
    assert [c.num_tokens for c in out.chunks] == [5, 6, 5]
    assert [c.samples for c in out.chunks] == [True, True, False]


# ---- first-token deadlines -----------------------------------------------------------------

def _ordered_scheduler(order: str, budget: int = 16) -> Scheduler:
    """Deadlines at 10 tokens a second."""
    return Scheduler(BlockManager(256, 4), token_budget=budget, max_num_seqs=64, policy="splitfuse",
                     prompt_order=order, first_token_deadline_tokens_per_s=10.0)


_prompt_numbers = itertools.count(1)


def _arrive(sched: Scheduler, name: str, length: int, at: float) -> Sequence:
    first = 1000 * next(_prompt_numbers)  # no prompt a prefix of another
    seq = Sequence(name, list(range(first, first + length)), SamplingParams(), arrival=first)
    seq.arrival_time = at
    sched.add(seq)
    return seq


def _step(sched: Scheduler, now: float = 0.0) -> list[tuple[str, int]]:
    """One step at `now`; a prompt ends with its first token."""
    out = sched.schedule(now)
    sampling = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    for seq in sampling:
        seq.append_token(7)
        sched.finish(seq)
    return [(c.seq.request_id, c.num_tokens) for c in out.chunks]


def test_short_prompt_overtakes_a_long_one_being_split_only_with_deadlines():
    for order, expected in [("arrival", [("long", 16)]), ("deadline", [("short", 6), ("long", 10)])]:
        sched = _ordered_scheduler(order)
        _arrive(sched, "long", 100, at=0.0)  # due at 10 s
        assert _step(sched) == [("long", 16)]
        _arrive(sched, "short", 6, at=0.5)  # due at 1.1 s
        assert _step(sched) == expected, order


def test_equal_deadlines_keep_arrival_order_and_a_preempted_prompt_keeps_its_deadline():
    sched = _ordered_scheduler("deadline", budget=20)
    a, b = _arrive(sched, "a", 20, at=0.0), _arrive(sched, "b", 10, at=1.0)  # both due at 2 s
    _arrive(sched, "c", 5, at=1.0)  # due at 1.5 s
    assert [s.request_id for s in sched.waiting] == ["c", "a", "b"]
    assert _step(sched) == [("c", 5), ("a", 15)]
    _arrive(sched, "d", 4, at=1.55)  # due at 1.95 s: before a and b
    sched._preempt(a)  # back in the queue by its deadline, still before b
    assert [s.request_id for s in sched.waiting] == ["d", "a", "b"]
    # a recomputes after the 3 full blocks the prefix cache kept of it; b fills the budget.
    assert _step(sched) == [("d", 4), ("a", 8), ("b", 8)] and a.num_preemptions == 1


def test_a_long_prompt_is_not_passed_forever():
    """Short prompts keep arriving, one a second (step), each due 0.5 s later; the long one, due
    at 10 s, gets what they leave until then, and from then on goes ahead of every later one."""
    sched = _ordered_scheduler("deadline", budget=8)
    long = _arrive(sched, "long", 100, at=0.0)
    ran = []
    for t in range(20):
        _arrive(sched, f"s{t}", 5, at=float(t))
        ran.append(_step(sched, float(t)))
    assert ran[:10] == [[(f"s{t}", 5), ("long", 3)] for t in range(10)]
    assert ran[10:18] == [[("long", 8)]] * 8  # s10 on (due 10.5 s on) wait
    assert ran[18] == [("long", 6), ("s10", 2)] and long.status is SequenceStatus.FINISHED


# ---- prefix caching ------------------------------------------------------------------------

FAMILIES = [[100 + 7 * f + k for k in range(90)] for f in range(3)]  # three distinct long prefixes


@st.composite
def shared_prefix_workloads(draw):
    """Requests whose prompts start with part of one of a few shared prefixes (like system
    prompts), some exactly repeated, followed by tokens of their own."""
    n = draw(st.integers(1, 20))
    requests, prompts = [], []
    for i in range(n):
        family = FAMILIES[draw(st.integers(0, len(FAMILIES) - 1))]
        shared = draw(st.integers(0, 60))
        own = draw(st.integers(0 if shared else 1, 20))
        prompt = family[:shared] + [5000 + 100 * i + k for k in range(own)]
        if prompts and draw(st.booleans()):
            prompt = list(draw(st.sampled_from(prompts)))  # the same prompt again
        prompts.append(prompt)
        requests.append(Request(
            prompt_len=len(prompt), output_len=draw(st.integers(1, 16)),
            arrive_step=draw(st.integers(0, 30)), abort_step=draw(st.one_of(st.none(), st.integers(0, 60))),
        ))
    return requests, prompts


def check_admissions(sched, out, before, budget):
    """A sequence admitted this step starts after whole cached blocks, never at its end."""
    for c in out.chunks:
        if id(c.seq) not in before or before[id(c.seq)][0] is not SequenceStatus.RUNNING:
            assert c.seq.num_computed_tokens % sched.blocks.block_size == 0
            assert c.seq.num_computed_tokens < c.seq.num_tokens
    if sched.policy == "splitfuse":
        check_splitfuse(sched, out, before, budget)


@settings(max_examples=150, deadline=None)
@given(
    workload=shared_prefix_workloads(),
    policy=st.sampled_from(["splitfuse", "splitfuse", "prefill_first", "orca"]),
    budget=st.integers(1, 96),
    block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 12),  # often a pool so small that cached blocks are evicted
)
def test_prefix_cache_properties_under_eviction_preemption_and_aborts(workload, policy, budget, block_size,
                                                                       extra_blocks):
    requests, prompts = workload
    simulate(requests, policy, budget, block_size, extra_blocks, max_num_seqs=8, prompts=prompts,
             check=check_admissions)


def test_request_admitted_while_another_is_split_hits_its_completed_blocks():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, token_budget=8, max_num_seqs=4, policy="splitfuse")
    prefix = list(range(10, 30))
    a = Sequence("a", prefix + [1], SamplingParams(), arrival=0)
    sched.add(a)
    out = sched.schedule()
    sched.advance(out)  # a's first chunk: 8 tokens = 2 full blocks computed
    b = Sequence("b", prefix + [2], SamplingParams(), arrival=1)
    sched.add(b)
    out = sched.schedule()  # a's second chunk fills the budget; b waits
    assert [c.seq for c in out.chunks] == [a]
    sched.advance(out)  # 16 computed: 4 blocks
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 5), (b, 3)]
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (21, 16)
    sched.advance(out)
    blocks.check_invariants([a, b])


def test_preempted_sequence_recomputes_after_its_cached_blocks():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, token_budget=64, max_num_seqs=4, policy="splitfuse")
    a = Sequence("a", list(range(10, 23)), SamplingParams(), arrival=0)
    sched.add(a)
    sched.advance(sched.schedule())
    a.append_token(99)  # 14 tokens, 13 computed: 3 full blocks
    sched._preempt(a)
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 2)]
    assert a.num_computed_tokens == 12 and a.num_cached_tokens == 0  # first admission's count
    assert out.prefix_cache_hits == 12


def test_caching_off_recomputes_everything():
    blocks = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(blocks, token_budget=64, max_num_seqs=4, policy="splitfuse")
    a = Sequence("a", list(range(10, 23)), SamplingParams(), arrival=0)
    sched.add(a)
    sched.advance(sched.schedule())
    b = Sequence("b", list(range(10, 23)), SamplingParams(), arrival=1)
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 0 and out.chunks[-1].num_tokens == 13
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (0, 0)


def test_a_step_that_preempts_admits_nothing():
    """Regression (found by the property test above): a decode preempted the newest sequence,
    whose prefix then stayed in the cache, and the same step re-admitted it as a prompt chunk
    ahead of a decode. A step that preempts admits nothing."""
    # (family, shared prefix length, first own token, own tokens), then prompt/output lengths.
    spec = [((1, 15, 5000, 20), 5, 1), ((0, 44, 5100, 20), 16, 0), ((None, 0, 5200, 1), 1, 0),
            ((None, 0, 5300, 1), 1, 0), ((None, 0, 5400, 1), 1, 0), ((None, 0, 5500, 18), 4, 1),
            ((0, 3, 5600, 20), 1, 2), ((None, 0, 5700, 1), 1, 0), ((None, 0, 5800, 1), 1, 0),
            ((1, 15, 5000, 20), 1, 0), ((0, 1, 0, 0), 3, 1), ((None, 0, 6100, 4), 2, 0)]
    requests, prompts = [], []
    for (family, shared, first, own), output_len, arrive_step in spec:
        prompt = (FAMILIES[family][:shared] if family is not None else []) + list(range(first, first + own))
        prompts.append(prompt)
        requests.append(Request(prompt_len=len(prompt), output_len=output_len, arrive_step=arrive_step,
                                abort_step=None))
    simulate(requests, "splitfuse", 12, 1, 4, max_num_seqs=8, prompts=prompts, check=check_admissions)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests_st, budget=st.integers(1, 64), block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 12), max_num_seqs=st.integers(1, 8), k=st.integers(1, 5),
    disable_batch=st.integers(1, 8), seed=st.integers(0, 1000), watermark=st.sampled_from([0.0, 0.1]),
)
def test_speculation_properties(requests, budget, block_size, extra_blocks, max_num_seqs, k, disable_batch, seed,
                                watermark):
    """Proposals accepted and rejected at random, under preemption, aborts and prefix caching:
    the budget holds (proposals included), every slot read was computed for its sequence's own
    prefix (rejected tokens' KV never leaks into a later read), block invariants hold, all
    requests finish and every block returns."""

    def check(sched, out, before, budget):
        check_splitfuse(sched, out, before, budget)
        decodes = sum(1 for c in out.chunks if before.get(id(c.seq), (None, None)) == (SequenceStatus.RUNNING, 1))
        for c in out.chunks:
            if c.num_draft_tokens:
                assert decodes <= disable_batch, "proposals verified in a step with too many decodes"
                assert c.num_tokens == 1 and c.num_draft_tokens <= len(c.seq.draft_token_ids)
                assert len(c.seq.block_table) * sched.blocks.block_size >= c.seq.num_tokens + c.num_draft_tokens

    simulate(requests, "splitfuse", budget, block_size, extra_blocks, max_num_seqs, watermark, check=check,
             speculation=(k, disable_batch, seed))
