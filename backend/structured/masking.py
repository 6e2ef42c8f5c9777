"""The engine's constrained sequences and their step: which rows are masked to their grammar
before sampling, which are sampled first and re-picked only when their token is refused, and
speculative proposals cut where their grammar refuses them.

The grammar cache is built at the first constrained request (it needs xgrammar, an optional
dependency) and may be asked for from servers' threads, which compile guides there.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.guide import Guide
from splitfuse.structured.matcher import Matcher

if TYPE_CHECKING:  # annotations only: the engine imports this package, not the reverse
    from splitfuse.engine.sampler import SampledToken
    from splitfuse.engine.scheduler import ScheduledChunk
    from splitfuse.engine.sequence import SamplingParams, Sequence

# A constrained row sampled before masking whose token its grammar refuses: how many of its
# best-scored tokens are tried before its whole mask is filled (a fill costs ~20x a check). SmolLM2
# under the bench's JSON schema: 17% of rows refused; 8 candidates left 34% of those to the whole
# mask, 32 left 16%, 256 left 6% for 2x the checks.
REPICK_CANDIDATES = 32


def masks_before_sampling(params: SamplingParams, num_drafts: int) -> bool:
    """Must this row be masked before it is sampled, or may it be sampled first and masked only
    if its token is refused?

    Sampling picks argmax(processed logits) (greedy) or argmax(probs / E) with noise E fixed per
    row (the sampler's exponential race): masking only removes competitors, so when the winner
    is allowed it is also the masked row's winner, and when it is not, the best-scored allowed
    token under the same noise is (the very token masking first gives). That fails where the
    mask changes what the sampler computes from the row: top-k / top-p cut the distribution by
    rank and mass (the masked row keeps other tokens), and log-probs are reported under the
    masked distribution. Speculative rows are filled together
    (each after its proposals), as verification reads them all.
    """
    return bool(num_drafts or params.logprobs or params.top_logprobs
                or (not params.greedy and (params.top_k > 0 or params.top_p < 1.0)))


class GrammarMasking:
    """The matchers of the constrained sequences in flight, by request id, and their masking."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._grammars: GrammarCache | None = None
        self._lock = threading.Lock()  # servers compile guides from their own threads
        self._matchers: dict[str, Matcher] = {}

    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache for this tokenizer (ValueError without xgrammar)."""
        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self._tokenizer, self._vocab_size)
            return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's process, if one was started."""
        with self._lock:
            if self._grammars is not None:
                self._grammars.close()

    def new_matcher(self, guide: Guide) -> Matcher:
        """A matcher at the start of `guide`'s grammar, not yet tracked (see `track`)."""
        return self.grammars().matcher(guide)

    def track(self, request_id: str, matcher: Matcher) -> None:
        self._matchers[request_id] = matcher

    def get(self, request_id: str) -> Matcher | None:
        return self._matchers.get(request_id)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @property
    def active(self) -> bool:
        """Whether any constrained sequence is in flight (else a step has nothing to mask)."""
        return bool(self._matchers)

    def mask(self, logits: torch.Tensor, sampling: list[ScheduledChunk]) -> list[tuple[int, Matcher]]:
        """Mask the constrained rows that must be masked before sampling to the tokens their
        grammar allows next (after each of its proposed tokens, for a speculative chunk), one
        bitmask applied in one call. Returns the other constrained rows (row, matcher): sampled
        first, checked after (`masks_before_sampling`)."""
        grammars = self.grammars()
        bitmask = None
        rows: list[int] = []
        unmasked: list[tuple[int, Matcher]] = []
        row = 0
        for chunk in sampling:
            matcher = self._matchers.get(chunk.seq.request_id)
            if matcher is None:
                pass
            elif masks_before_sampling(chunk.seq.params, chunk.num_draft_tokens):
                if bitmask is None:
                    bitmask = grammars.new_bitmask(logits.shape[0])
                rows += matcher.fill_drafts_(bitmask, row, chunk.seq.draft_token_ids[: chunk.num_draft_tokens])
            else:
                unmasked.append((row, matcher))
            row += 1 + chunk.num_draft_tokens
        if rows:
            with torch.inference_mode():  # the logits are the forward pass's inference tensors
                grammars.apply_bitmask_(logits, bitmask, rows)
        return unmasked

    def repick(self, scores: list, sampled: list[SampledToken | Exception],
               unmasked: list[tuple[int, Matcher]]) -> None:
        """The rows sampled before masking whose token their grammar refuses get the token they
        would have drawn masked (SamplerOutput.scores), in place in `sampled`: the best-scored
        allowed token among the first few, else the argmax of the row's scores under its whole
        mask (log-probs: none, such rows are masked before sampling)."""
        for row, matcher in unmasked:
            got = sampled[row]
            if isinstance(got, Exception) or matcher.allows(got[0]):
                continue
            row_scores = scores[row]
            values, ids = row_scores.topk(min(REPICK_CANDIDATES, row_scores.shape[0]))
            token = matcher.first_allowed(ids[values > float("-inf")].tolist())
            if token is None:
                grammars = self.grammars()
                bitmask = grammars.new_bitmask(1)
                matcher.fill_(bitmask, 0)
                masked = row_scores[None].clone()
                grammars.apply_bitmask_(masked, bitmask, [0])
                token = int(masked.argmax())
            sampled[row] = (token, *got[1:])

    def cut_drafts(self, seqs: list[Sequence]) -> None:
        """Cut each constrained sequence's proposals at the first token its grammar refuses
        (verification would reject it, and the rows after it would be wasted)."""
        for seq in seqs:
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None and seq.draft_token_ids:
                del seq.draft_token_ids[matcher.allowed_prefix(seq.draft_token_ids):]
