"""One constrained sequence's place in its grammar: the logits mask before sampling, the
sampled tokens accepted after."""

from __future__ import annotations

from typing import Any

import torch


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int, forbidden: torch.Tensor | None = None) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)
        self.vocab_size = vocab_size
        self._forbidden = forbidden
        """Tokens never to sample besides what the grammar forbids (see GrammarCache)."""

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end token was accepted: nothing may follow."""
        return self._m.is_terminated()

    def mask_(self, logits_row: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf, in place."""
        self._m.fill_next_token_bitmask(self._bitmask, 0)
        allowed = ((self._bitmask[0].unsqueeze(-1) >> self._bits) & 1).reshape(-1)[: self.vocab_size].bool()
        if self._forbidden is not None:
            allowed &= ~self._forbidden
        n = min(logits_row.shape[-1], self.vocab_size)
        row = logits_row[:n]
        row.masked_fill_(~allowed[:n].to(row.device), float("-inf"))
        if logits_row.shape[-1] > n:  # padded vocabulary rows no tokenizer token maps to
            logits_row[n:] = float("-inf")

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

    def mask_drafts_(self, logits_rows: torch.Tensor, drafts: list[int]) -> None:
        """Mask the rows of a speculative chunk: row i is sampled after the first i proposed
        tokens, so it gets the grammar's mask in that state. Rows past a proposal the grammar
        refuses stay as they are: verification stops at that row (its sampled token is allowed,
        so it differs from the refused proposal) and never reads them. The matcher is left
        where it was; the tokens verification accepts are taken with `accept`."""
        taken = 0
        for i in range(logits_rows.shape[0]):
            if self._m.is_terminated():  # a proposal ended the grammar: the sequence ends there
                break
            self.mask_(logits_rows[i])
            if i == len(drafts) or not self._m.accept_token(drafts[i]):
                break
            taken += 1
        if taken:
            self._m.rollback(taken)
