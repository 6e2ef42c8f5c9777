"""One constrained sequence's place in its grammar: its rows of the step's token bitmask before
sampling, the sampled tokens accepted after.

A step fills one bitmask (32 tokens a word) for all constrained rows, each matcher its own rows,
and applies it to the logits in one call (xgrammar's kernel); building a boolean mask per row and
sequence took about a quarter of a 16-sequence decode step on SmolLM2's 49k vocabulary.

Most rows need no mask at all: a row sampled from its whole distribution whose token the grammar
allows has the token the masked row would have had (`masking.masks_before_sampling`); a refused
row takes its best-scored allowed token, found among its first few candidates or, failing that,
under its whole mask. Filling a row's mask costs ~20x checking one token.
"""

from __future__ import annotations

from typing import Any

import torch


def new_bitmask(xgr: Any, num_rows: int, vocab_size: int) -> torch.Tensor:
    """A step's bitmask: every token allowed in every row until a matcher fills its rows."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask_(xgr: Any, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set the logits the filled `rows` of `bitmask` forbid to -inf, in place; padded vocabulary
    columns (no token maps to them) too."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    if logits.shape[-1] > vocab_size:
        logits[torch.tensor(rows, device=logits.device), vocab_size:] = float("-inf")


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int, keep_words: torch.Tensor | None = None) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size  # logits may be wider (padded columns): never allowed
        self._keep = keep_words
        """Bitmask words clearing the tokens never to sample besides what the grammar forbids (see
        GrammarCache); None: the grammar alone decides."""

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end token was accepted: nothing may follow."""
        return self._m.is_terminated()

    def fill_(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens the grammar allows next."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._keep is not None:
            bitmask[row] &= self._keep

    def allows(self, token: int) -> bool:
        """May `token` come next? (The matcher is left where it was.)"""
        if not 0 <= token < self._vocab_size:
            return False
        if self._keep is not None and not (int(self._keep[token >> 5]) >> (token & 31)) & 1:
            return False
        if self._m.is_terminated() or not self._m.accept_token(token):
            return False
        self._m.rollback(1)
        return True

    def first_allowed(self, tokens: list[int]) -> int | None:
        """The first of `tokens` that may come next, or None."""
        return next((t for t in tokens if self.allows(t)), None)

    def accept(self, token: int) -> None:
        if not self._m.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the request's grammar")

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, taken in order from here, the grammar allows (the matcher is
        left where it was)."""
        n = 0
        for token in tokens:
            if self._m.is_terminated() or not self._m.accept_token(token):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def fill_drafts_(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> list[int]:
        """Fill the rows of a speculative chunk (`first_row` onwards) and return them: row i is
        sampled after the first i proposed tokens, so it gets the grammar's mask in that state.
        Rows past a proposal the grammar refuses are left out: verification stops at that row
        (its sampled token is allowed, so it differs from the refused proposal) and never reads
        them. The matcher is left where it was; the tokens verification accepts are taken with
        `accept`."""
        rows: list[int] = []
        taken = 0
        for i in range(len(drafts) + 1):
            if self._m.is_terminated():  # a proposal ended the grammar: the sequence ends there
                break
            self.fill_(bitmask, first_row + i)
            rows.append(first_row + i)
            if i == len(drafts) or not self._m.accept_token(drafts[i]):
                break
            taken += 1
        if taken:
            self._m.rollback(taken)
        return rows
