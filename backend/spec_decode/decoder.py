"""Speculative decoding: proposals before a step, verification after it.

A decoding sequence gets up to `num_speculative_tokens` proposed tokens (n-gram lookup or a
draft model, both deterministic given the sequence); the scheduler runs them after the
sequence's one token in the same SplitFuse step, so one pass yields logits for every position.

Verification is the standard rejection rule for a proposal that puts all its mass on one token
d: accept d with probability p(d), else draw from p with d removed. Drawn as a coupling: the
token at each position is sampled exactly as the plain path samples it (same sampler, same
per-position seed) and d is accepted when the sample equals it; a rejected position keeps the
sample, which is then distributed as p without d. So the output distribution is the model's,
greedy output is token-identical to decoding without speculation, and a seeded request draws
the same tokens with or without it, whatever shares its batch.

Adaptive: each sequence keeps an acceptance rate (the share of its proposals accepted, an
exponential average) and asks for about that share of `num_speculative_tokens` (at least one),
so a poor proposer costs few verification rows and draft passes; below a floor the sequence
pauses speculating for a number of steps that doubles while it stays poor. A new sequence
starts from the rate over all sequences so far, so a draft model that is always wrong stops
being asked soon for every request, not after a few rounds of each. A step that decodes more
sequences than `speculative_disable_batch_size` runs no proposals (the scheduler's rule): the
pass is compute-bound there and verification would cost what it saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from weakref import WeakKeyDictionary

from splitfuse.config import EngineConfig
from splitfuse.engine.scheduler import ScheduledChunk, Scheduler
from splitfuse.engine.sequence import Sequence
from splitfuse.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from splitfuse.engine.sampler import SampledToken

_RATE_SMOOTHING = 0.5
"""Weight of the newest verification in a sequence's acceptance rate (exponential average)."""
_OVERALL_SMOOTHING = 0.1
"""The same for the rate over all sequences, a new sequence's starting rate."""
_MIN_RATE = 0.2
"""Below this acceptance rate a sequence pauses speculating."""
_FIRST_PAUSE, _LONGEST_PAUSE = 2, 64
"""Steps a poor sequence pauses, doubled at each poor probe up to the longest."""


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] tokens to follow seqs[i]'s tokens."""

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted)."""


@dataclass
class _Acceptance:
    rate: float = 1.0
    paused_until: int = 0
    pause: int = _FIRST_PAUSE


class DraftPrefix:
    """`seq` as it would be after its first `n` proposed tokens: what the sampler reads to pick
    the token at that position (its parameters, output index for min_tokens and the seed,
    tokens for the penalties)."""

    __slots__ = ("seq", "n")

    def __init__(self, seq: Sequence, n: int) -> None:
        self.seq, self.n = seq, n

    @property
    def params(self):
        return self.seq.params

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.n

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[: self.n]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.draft_token_ids[: self.n]


def sampling_rows(chunks: list[ScheduledChunk]) -> list:
    """One sampler row per logits row of the sampling chunks: the sequence, then the sequence
    after each of its proposed tokens."""
    rows: list = []
    for c in chunks:
        rows.append(c.seq)
        rows.extend(DraftPrefix(c.seq, i) for i in range(1, c.num_draft_tokens + 1))
    return rows


def verified_tokens(chunk: ScheduledChunk, rows: list[SampledToken | Exception]) -> list[SampledToken]:
    """The tokens (with their log-probs and alternatives, each from its own row) a sampling
    chunk yields: the proposals its rows confirmed, then the token sampled where the first one
    failed (or after the last). Raises what sampling a needed row raised."""
    drafts = chunk.seq.draft_token_ids[: chunk.num_draft_tokens]
    out: list[SampledToken] = []
    for i, row in enumerate(rows):
        if isinstance(row, Exception):
            raise row
        out.append(row)
        if i == len(drafts) or row[0] != drafts[i]:
            break
    return out


def make_speculative_decoder(config: EngineConfig, max_model_len: int,
                             vocab_size: int) -> SpeculativeDecoder | None:
    """The decoder `speculative_method` asks for; None for "none"."""
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from splitfuse.spec_decode.draft import DraftModelProposer  # loads a second model

        proposer = DraftModelProposer(config, vocab_size)
    return SpeculativeDecoder(config, proposer, max_model_len)


class SpeculativeDecoder:
    def __init__(self, config: EngineConfig, proposer: Proposer, max_model_len: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._acceptance: WeakKeyDictionary[Sequence, _Acceptance] = WeakKeyDictionary()
        self._step = 0
        self._overall_rate = 1.0
        self.num_proposed = 0
        """Proposed tokens verified over the engine's life (with `num_accepted`: its acceptance rate)."""
        self.num_accepted = 0

    def propose(self, seqs: list[Sequence]) -> None:
        """Set `draft_token_ids` of the decoding sequences `seqs` for the next step."""
        self._step += 1
        asking, limits = [], []
        for seq in seqs:
            seq.draft_token_ids = []
            state = self._acceptance.get(seq)
            if state is None:
                state = self._acceptance[seq] = self._new_state()
            if state.paused_until > self._step:
                continue
            # About the share of k the sequence's proposals have been accepted at (at least one);
            # the token sampled after them counts too: never past max_tokens or the context.
            limit = min(max(1, math.ceil(state.rate * self.num_speculative_tokens)),
                        seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                asking.append(seq)
                limits.append(limit)
        if asking:
            for seq, drafts in zip(asking, self.proposer.propose(asking, limits)):
                seq.draft_token_ids = drafts

    def propose_next(self, scheduler: Scheduler) -> list[Sequence]:
        """Proposals for the sequences the next step decodes, if it may speculate (else their
        old proposals are dropped); returns those sequences."""
        # An embedding's last prompt token is no decode: it samples nothing to verify proposals.
        decoding = [s for s in scheduler.running if s.num_uncomputed_tokens == 1 and s.pooling is None]
        if not scheduler.may_speculate(len(decoding)):
            for seq in decoding:
                seq.draft_token_ids = []
            return decoding
        self.propose(decoding)
        return decoding

    def settle(self, scheduler: Scheduler, chunk: ScheduledChunk, num_accepted: int, finished: bool) -> None:
        """After verifying `chunk`'s proposals: its acceptance rate, and the KV slots of the
        rejected ones handed back (a finished sequence has freed them all)."""
        self.record(chunk.seq, chunk.num_draft_tokens, num_accepted)
        if not finished:
            scheduler.accept_drafts(chunk.seq, num_accepted)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Update `seq`'s acceptance rate after a verification; pause it while poor."""
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        share = num_accepted / num_proposed
        self._overall_rate += _OVERALL_SMOOTHING * (share - self._overall_rate)
        state = self._acceptance.get(seq)
        if state is None:
            state = self._acceptance[seq] = self._new_state()
        state.rate += _RATE_SMOOTHING * (share - state.rate)
        if state.rate >= _MIN_RATE:
            state.pause = _FIRST_PAUSE
        else:
            state.paused_until = self._step + state.pause
            state.pause = min(2 * state.pause, _LONGEST_PAUSE)

    def _new_state(self) -> _Acceptance:
        state = _Acceptance(rate=self._overall_rate)
        if state.rate < _MIN_RATE:
            state.paused_until = self._step + state.pause
        return state

    def release(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.proposer.release(seq)
