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
