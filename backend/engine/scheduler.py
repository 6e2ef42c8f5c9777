"""Decides, each step, which sequences run and how many of their tokens.

Policies:
- splitfuse (DeepSpeed-FastGen's Dynamic SplitFuse): every step fills a fixed token budget:
  running decodes first (one token each), then the continuation of prompts already being
  split, then new prompts; the last prompt that fits is cut so the budget is met exactly.
- prefill_first (vLLM v0 style baseline): whole new prompts run in a pass of their own
  before decodes continue.
- orca (baseline): whole prompts join the running decode batch.

The scheduler never touches tensors; it asks the BlockManager for room. When a running
sequence cannot get a block, the last one in running order is preempted (its KV freed, to be
recomputed later). Every request is checked at admission to fit the pool on its own, so
the first one in running order can always make progress: no deadlock.

Request priority (SamplingParams.priority, HIGHER first): running sequences are kept by priority,
then arrival, so decodes run highest priority first and the victim of a preemption is the
lowest-priority sequence, the newest among equals. The waiting queue is in priority order, each
priority in the prompt order below; a waiting prompt of higher priority also goes before the
rest of a lower-priority prompt being split. Strict: a steady load of higher priority can keep a
lower one waiting. With all priorities equal (the default 0) nothing changes.

Speculative decoding: a decoding sequence with proposed tokens (`draft_token_ids`) gets up to
all of them after its one token, from the budget the step's decodes leave, when the step
decodes few enough sequences for the pass to stay memory-bound; their KV slots are reserved
like any other and handed back by `accept_drafts` past what the verification accepted.

Prompt order (prompt_order.py): arrival order, or by first-token deadline (prompts being split
and new ones together), or by deadline with the prompts that cannot make theirs last (goodput).

Prefix caching: a sequence is admitted after the longest prefix of full blocks the cache
holds (the BlockManager's `lookup`), so its first chunk starts at that offset; after each
step `advance` makes the blocks a chunk filled findable for requests admitted later. With tiers
below the pool (`tier_prefix`, kv_tiers/), the chain goes on past the pool's hits into them: the
blocks found there are counted computed at admission and listed in `SchedulerOutput.restores`,
for the engine to copy their KV in before the forward pass; `restored` then records how many
arrived (one that failed to load ends the restored prefix: the rest is computed this step on).

LoRA adapters: running sequences use at most `max_loras` adapters. A waiting sequence whose
adapter would be one too many waits, but does not hold up the queue: later base requests and
requests of running adapters are admitted past it. Once it has waited LORA_BYPASS_STEPS steps,
no new sequence of a running adapter is admitted past it, so those adapters drain and free a
slot for it (base requests still pass: they take no slot).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitfuse.engine.block_manager import BlockManager
from splitfuse.engine.prompt_order import PromptOrder
from splitfuse.engine.sequence import Sequence, SequenceStatus

# Steps a waiting sequence blocked by max_loras lets requests of running adapters pass it before
# those stop being admitted: long enough to keep a busy adapter's batch full across a short wait,
# short next to a generation, so the blocked request is served within about one request's time.
LORA_BYPASS_STEPS = 64


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    """New tokens computed for `seq` this step, starting at `seq.num_computed_tokens`."""
    num_draft_tokens: int = 0
    """Proposed tokens (`seq.draft_token_ids[:n]`) run after those, to be verified."""

    @property
    def samples(self) -> bool:
        """Only the chunk that reaches the sequence's last token samples the next one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


def sampling_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """The chunks that sample a token (an embedding's last chunk is pooled instead), in order:
    their rows are the step's sampling rows. Read before the scheduler advances past them."""
    return [c for c in chunks if c.samples and c.seq.pooling is None]


@dataclass
class TierRestore:
    """Blocks of `seq` a tier below the pool holds: its block table's entries from `first_block`
    on, one per hash, counted computed already; their KV is to be copied in before the forward."""

    seq: Sequence
    first_block: int
    hashes: list[bytes]
    first_admission: bool
    """This admission set the sequence's num_cached_tokens (a failed restore lowers it too)."""


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted this step that were looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found in the pool (their KV is reused, not computed)."""
    restores: list[TierRestore] = field(default_factory=list)
    """Blocks of the sequences admitted this step to copy in from the tiers below the pool."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens + c.num_draft_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, token_budget: int, max_num_seqs: int, policy: str,
                 speculative_disable_batch_size: int = 0, max_loras: int | None = None,
                 prompt_order: str = "arrival", first_token_deadline_tokens_per_s: float = 512.0,
                 tier_prefix: Callable[[list[bytes]], int] | None = None) -> None:
        self.blocks = block_manager
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.speculative_disable_batch_size = speculative_disable_batch_size
        # Running sequences use at most max_loras LoRA adapters together, so every step's fit in
        # the resident set (None: no bound).
        self.max_loras = max_loras
        self.prompt_order = PromptOrder(prompt_order, first_token_deadline_tokens_per_s, token_budget)
        # How many of a chain's block hashes, from the first, the tiers below the pool hold.
        self.tier_prefix = tier_prefix
        self._running_loras: Counter[str] = Counter()
        self._lora_blocked: Sequence | None = None  # the first waiting sequence max_loras holds back
        self._lora_blocked_steps = 0  # steps it has been so
        self._schedule_fn = {
            "splitfuse": self._schedule_splitfuse,
            "prefill_first": self._schedule_prefill_first,
            "orca": self._schedule_orca,
        }[policy]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in running order: priority (highest first), then arrival
        self._running_keys: list[tuple[int, int]] = []
        self.num_preemptions = 0  # over the scheduler's life, for tests and metrics

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Queue `seq` after every waiting sequence of higher priority and before every one of lower;
        among its equals by the prompt order (prompt_order.py): in arrival order at the back (a new
        request) or at the front (a preempted one, to be recomputed first), or by deadline."""
        waiting = self.waiting
        if self.prompt_order.by_deadline:
            key = self._prompt_key(seq)
            idx = len(waiting)
            while idx and self._prompt_key(waiting[idx - 1]) > key:
                idx -= 1
        elif front:
            idx = 0
            while idx < len(waiting) and waiting[idx].params.priority > seq.params.priority:
                idx += 1
        else:  # the common case (equal priorities) stops at once
            idx = len(waiting)
            while idx and waiting[idx - 1].params.priority < seq.params.priority:
                idx -= 1
        waiting.insert(idx, seq)

    def _prompt_key(self, seq: Sequence) -> tuple:
        """Sort key of prompts with a prompt order by deadline: priority, then that order's key."""
        return -seq.params.priority, *self.prompt_order.priority(seq)

    def _goes_before(self, split: Sequence, new: Sequence) -> bool:
        """Whether the rest of a prompt being split runs before a new prompt: by deadline, as the
        order ranks them; by arrival, unless the new one has a higher priority."""
        if self.prompt_order.by_deadline:
            return self._prompt_key(split) < self._prompt_key(new)
        return split.params.priority >= new.params.priority

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self._remove_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """The next step's work; `now` for the goodput order (time.monotonic(), read only there,
        when not given)."""
        self._track_lora_blocked()
        return self._schedule_fn(now)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` took `seconds` (the engine's rate, for the goodput order)."""
        self.prompt_order.record_step(num_tokens, seconds)

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step `out` ran: each chunk's tokens are computed now, and the
        blocks they filled become findable in the prefix cache (also by requests admitted
        while this one is still being split)."""
        for c in out.chunks:
            before = c.seq.num_computed_tokens
            c.seq.num_computed_tokens += c.num_tokens
            self.blocks.cache_computed_blocks(c.seq, before)

    def restored(self, restore: TierRestore, num_blocks: int) -> None:
        """Record that the first `num_blocks` blocks of `restore` have their KV copied in: they
        become findable in the pool's prefix cache; those past them (a block failed to load) are
        computed instead, from the first of them, by the sequence's chunk this step."""
        seq, bs = restore.seq, self.blocks.block_size
        lost = (len(restore.hashes) - num_blocks) * bs
        if lost:
            seq.num_computed_tokens -= lost
            if restore.first_admission:
                seq.num_cached_tokens -= lost
        self.blocks.cache_computed_blocks(seq, restore.first_block * bs)

    def may_speculate(self, num_decodes: int) -> bool:
        """Whether a step decoding `num_decodes` sequences runs their proposed tokens."""
        return 0 < num_decodes <= self.speculative_disable_batch_size

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """Record a verification: the first `num_accepted` proposed tokens (appended to `seq` by
        now) have their KV computed; the slots of rejected ones are returned (blocks past what
        the sequence's tokens need)."""
        before = seq.num_computed_tokens
        seq.num_computed_tokens += num_accepted
        self.blocks.cache_computed_blocks(seq, before)
        self.blocks.trim(seq, seq.num_tokens)

    # ---- policies -----------------------------------------------------------------------
    def _schedule_splitfuse(self, now: float | None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_decodes(out, self.token_budget)
        # Then prompts: in arrival order those already being split (their blocks were reserved at
        # admission) before new ones of their priority; by deadline all of them in key order. The
        # last one scheduled is cut to fill the budget exactly.
        split = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        order = self.prompt_order
        if order.order == "goodput" and order.tokens_per_s is not None:
            # The budget left after the decodes is what prompts get of the engine's rate.
            prompt_rate = order.tokens_per_s * budget / self.token_budget
            step_s = self.token_budget / order.tokens_per_s
            now = time.monotonic() if now is None else now
            if order.defer_hopeless(split + list(self.waiting), now, prompt_rate, step_s):
                self.waiting = deque(sorted(self.waiting, key=self._prompt_key))
        if order.by_deadline:
            split.sort(key=self._prompt_key)
        admitting = True  # until a new prompt does not fit (FIFO: none after it either)
        while budget > 0:
            head = self._next_waiting(out) if admitting else None
            if split and (head is None or self._goes_before(split[0], head)):
                seq = split.pop(0)
            elif head is None:
                break
            elif self._admit(head, out):
                seq = head
            else:
                admitting = False
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return out

    def _schedule_prefill_first(self, now: float | None) -> SchedulerOutput:
        out = SchedulerOutput()
        # A pass of whole prompts whenever one can be admitted; the first always runs whole,
        # even past the budget (this baseline does not split prompts).
        used = 0
        while (head := self._next_waiting(out)) is not None:
            if out.chunks and used + head.num_uncomputed_tokens > self.token_budget:
                break
            if not self._admit(head, out):
                break
            out.chunks.append(ScheduledChunk(head, head.num_uncomputed_tokens))
            used += head.num_uncomputed_tokens
        if out.chunks:
            return out
        self._schedule_decodes(out, self.token_budget)
        return out

    def _schedule_orca(self, now: float | None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_decodes(out, self.token_budget)
        # Whole prompts join the decode batch while they fit; a batch with no other work
        # takes the head prompt whole even past the budget, or it would never run.
        while (head := self._next_waiting(out)) is not None:
            if out.chunks and head.num_uncomputed_tokens > budget:
                break
            if not self._admit(head, out):
                break
            out.chunks.append(ScheduledChunk(head, head.num_uncomputed_tokens))
            budget = max(0, budget - head.num_uncomputed_tokens)
        return out

    # ---- shared steps -------------------------------------------------------------------
    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule one token for each running sequence that has exactly one to compute, in
        running order, preempting from the end of that order when a block is missing (the victim
        is never one already scheduled this step)."""
        block_size = self.blocks.block_size
        running = SequenceStatus.RUNNING
        for seq in list(self.running):
            if budget == 0:
                break
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_computed_tokens != 1 or seq.status is not running:
                continue
            # Hot path: the sequence's last block still has room.
            if len(seq.block_table) * block_size < num_tokens:
                while not self.blocks.can_grow(seq, num_tokens):
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
                self.blocks.grow(seq, num_tokens)
            out.chunks.append(ScheduledChunk(seq, 1))
            budget -= 1
        return self._schedule_drafts(out, budget)

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Give the step's decodes their proposed tokens, in running order, from the budget left,
        each as far as the pool allows without dipping into the watermark (a proposal never
        preempts anyone)."""
        if not self.may_speculate(len(out.chunks)):  # always so with speculation off: no scan
            return budget
        decodes = [c for c in out.chunks if c.seq.draft_token_ids]
        block_size = self.blocks.block_size
        for c in decodes:
            if budget == 0:
                break
            seq = c.seq
            n = min(len(seq.draft_token_ids), budget)
            room = len(seq.block_table) * block_size - seq.num_tokens
            spare_blocks = self.blocks.num_free_blocks - self.blocks.watermark_blocks
            room += max(0, spare_blocks) * block_size
            n = min(n, room)
            if n <= 0:
                continue
            self.blocks.grow(seq, seq.num_tokens + n)
            c.num_draft_tokens = n
            budget -= n
        return budget

    def _lora_waits(self, lora: str | None) -> bool:
        """Whether a sequence of adapter `lora` would make the running adapters one too many."""
        return (lora is not None and self.max_loras is not None and lora not in self._running_loras
                and len(self._running_loras) >= self.max_loras)

    def _track_lora_blocked(self) -> None:
        """Note the first waiting sequence max_loras holds back, and for how many steps."""
        blocked = None
        if self.max_loras is not None and len(self._running_loras) >= self.max_loras:
            blocked = next((s for s in self.waiting if self._lora_waits(s.params.lora_name)), None)
        if blocked is not None and blocked is self._lora_blocked:
            self._lora_blocked_steps += 1
        else:
            self._lora_blocked, self._lora_blocked_steps = blocked, 0

    def _next_waiting(self, out: SchedulerOutput) -> Sequence | None:
        """The waiting sequence to admit next: the first in the queue, past those whose adapter
        waits for a slot (max_loras), and past a starved one only for base requests. None when
        admission stops this step."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        if out.preempted:
            # The pool ran out this step: admitting now could take back the very blocks a
            # preemption just freed (a victim's cached prefix) and preempt again next step.
            return None
        starved = False  # past a sequence held back LORA_BYPASS_STEPS steps: base requests only
        for seq in self.waiting:
            lora = seq.params.lora_name
            if lora is None or not (starved or self._lora_waits(lora)):
                return seq
            if seq is self._lora_blocked and self._lora_blocked_steps >= LORA_BYPASS_STEPS:
                starved = True
        return None

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Move waiting `seq` to running if its KV fits, starting it after the longest prefix the
        cache holds. A sequence that does not fit stops admission for the step (FIFO), so long
        prompts are not starved by short ones."""
        lora = seq.params.lora_name
        cached = self.blocks.lookup(seq)
        if not self.blocks.can_admit(seq, seq.num_tokens, cached):
            return False
        restore = []  # restored blocks take fresh blocks, which can_admit counted already
        if self.tier_prefix is not None:
            candidates = self.blocks.tier_candidates(seq, len(cached))
            restore = candidates[: self.tier_prefix(candidates)] if candidates else []
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        self.blocks.take_cached(seq, cached)
        self.blocks.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = (len(cached) + len(restore)) * self.blocks.block_size
        first_admission = seq.num_cached_tokens is None
        if first_admission:
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.blocks.enable_prefix_caching:
            out.prefix_cache_queries += seq.num_tokens
            out.prefix_cache_hits += len(cached) * self.blocks.block_size
        if restore:
            out.restores.append(TierRestore(seq, len(cached), restore, first_admission))
        seq.status = SequenceStatus.RUNNING
        key = (-seq.params.priority, seq.arrival)
        idx = bisect.bisect(self._running_keys, key)
        self.running.insert(idx, seq)
        self._running_keys.insert(idx, key)
        if lora is not None:
            self._running_loras[lora] += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s KV and put it back at the head of the queue to be recomputed."""
        self._remove_running(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)

    def _remove_running(self, seq: Sequence) -> None:
        idx = self.running.index(seq)
        del self.running[idx]
        del self._running_keys[idx]
        lora = seq.params.lora_name
        if lora is not None:
            self._running_loras[lora] -= 1
            if not self._running_loras[lora]:
                del self._running_loras[lora]
