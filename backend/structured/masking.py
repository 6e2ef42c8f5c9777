"""The engine's constrained sequences and their step: which rows are masked to their grammar
before sampling, which are sampled first and re-picked only when their token is refused, and
speculative proposals cut where their grammar refuses them.

The grammar cache is built at the first constrained request (it needs xgrammar, an optional
dependency) and may be asked for from servers' threads, which compile guides there.

Grammar work is contained per request, as sampling is: a matcher that raises, or whose work in
one step takes longer than the step budget (`grammar_step_budget_ms`), puts an exception in its
request's sampled rows, and the engine ends that request alone (its KV blocks freed). The budget
is checked after the work: a step is slowed by at most one overrun per constrained request,
which then ends.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from splitfuse.config import GrammarLimits
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


class GrammarStepError(RuntimeError):
    """A request's grammar work failed or overran the step budget: that request ends alone."""


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

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits = GrammarLimits()) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self.step_budget_s = limits.step_budget_s
        self._vocab_size = vocab_size
        self._grammars: GrammarCache | None = None
        self._lock = threading.Lock()  # servers compile guides from their own threads
        self._matchers: dict[str, Matcher] = {}

    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache for this tokenizer (ValueError without xgrammar)."""
        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self._tokenizer, self._vocab_size, self._limits)
            return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's process, if one was started."""
        with self._lock:
            if self._grammars is not None:
                self._grammars.close()

    def new_matcher(self, guide: Guide, compiled: Any = None) -> Matcher:
        """A matcher at the start of `guide`'s grammar (`compiled`, if at hand), not yet tracked
        (see `track`)."""
        return self.grammars().matcher(guide, compiled)

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

    def mask(self, logits: torch.Tensor, sampling: list[ScheduledChunk],
             failed: dict[int, Exception]) -> list[tuple[int, Matcher]]:
        """Mask the constrained rows that must be masked before sampling to the tokens their
        grammar allows next (`fill`), one bitmask applied in one call. Returns the other
        constrained rows (row, matcher): sampled first, checked after (`masks_before_sampling`)."""
        bitmask, rows, unmasked = self.fill(sampling, logits.shape[0], failed)
        if rows:
            with torch.inference_mode():  # the logits are the forward pass's inference tensors
                self.grammars().apply_bitmask_(logits, bitmask, rows)
        return unmasked

    def fill(self, sampling: list[ScheduledChunk], num_rows: int, failed: dict[int, Exception],
             every: bool = False) -> tuple[torch.Tensor | None, list[int], list[tuple[int, Matcher]]]:
        """The bitmask of the sampling rows (after each proposed token, for a speculative chunk) of
        the constrained rows that must be masked before sampling, or of every constrained row with
        `every`; the rows filled; the constrained rows left (row, matcher). A chunk whose matcher
        raises or overruns the step budget gets its error in `failed` for each of its rows."""
        bitmask = None
        rows: list[int] = []
        unmasked: list[tuple[int, Matcher]] = []
        row = 0
        for chunk in sampling:
            matcher = self._matchers.get(chunk.seq.request_id)
            width = 1 + chunk.num_draft_tokens
            if matcher is None:
                pass
            elif every or masks_before_sampling(chunk.seq.params, chunk.num_draft_tokens):
                if bitmask is None:
                    bitmask = self.grammars().new_bitmask(num_rows)
                start = time.perf_counter()
                try:
                    filled = matcher.fill_drafts_(bitmask, row, chunk.seq.draft_token_ids[: chunk.num_draft_tokens])
                    self._check_budget(start)
                    rows += filled
                except Exception as e:
                    failed.update((r, _contained(e)) for r in range(row, row + width))
            else:
                unmasked.append((row, matcher))
            row += width
        return bitmask, rows, unmasked

    @property
    def vocab_size(self) -> int:
        """The vocabulary the bitmasks cover (the model's)."""
        return self._vocab_size

    def _check_budget(self, start: float) -> None:
        took = time.perf_counter() - start
        if took > self.step_budget_s:
            raise GrammarStepError(f"the request's grammar took {took * 1e3:.0f} ms in one step, over "
                                   f"grammar_step_budget_ms ({self.step_budget_s * 1e3:g} ms)")

    def repick(self, scores: list, sampled: list[SampledToken | Exception],
               unmasked: list[tuple[int, Matcher]]) -> None:
        """The rows sampled before masking whose token their grammar refuses get the token they
        would have drawn masked (SamplerOutput.scores), in place in `sampled`: the best-scored
        allowed token among the first few, else the argmax of the row's scores under its whole
        mask (log-probs: none, such rows are masked before sampling)."""
        for row, matcher in unmasked:
            got = sampled[row]
            if isinstance(got, Exception):
                continue
            start = time.perf_counter()
            try:
                token = self._repick_row(scores[row], got[0], matcher)
                self._check_budget(start)
            except Exception as e:
                sampled[row] = _contained(e)
                continue
            sampled[row] = (token, *got[1:])

    def _repick_row(self, row_scores: torch.Tensor, token: int, matcher: Matcher) -> int:
        """`token` if its grammar allows it, else the token the masked row would have had."""
        if matcher.allows(token):
            return token
        values, ids = row_scores.topk(min(REPICK_CANDIDATES, row_scores.shape[0]))
        allowed = matcher.first_allowed(ids[values > float("-inf")].tolist())
        if allowed is not None:
            return allowed
        grammars = self.grammars()
        bitmask = grammars.new_bitmask(1)
        matcher.fill_(bitmask, 0)
        masked = row_scores[None].clone()
        grammars.apply_bitmask_(masked, bitmask, [0])
        return int(masked.argmax())

    def cut_drafts(self, seqs: list[Sequence]) -> None:
        """Cut each constrained sequence's proposals at the first token its grammar refuses
        (verification would reject it, and the rows after it would be wasted)."""
        for seq in seqs:
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None and seq.draft_token_ids:
                try:
                    keep = matcher.allowed_prefix(seq.draft_token_ids)
                except Exception:  # no proposals; its next step's mask meets the error and ends it
                    keep = 0
                del seq.draft_token_ids[keep:]


def _contained(e: Exception) -> Exception:
    """The error a request ends with when its grammar work failed."""
    if isinstance(e, GrammarStepError):
        return e
    return GrammarStepError(f"the request's grammar failed: {type(e).__name__}: {e}")
