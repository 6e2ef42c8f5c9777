"""N-gram prompt lookup, the proposer of `speculative_method=ngram`.

The sequence's last n tokens (n from `ngram_max` down to `ngram_min`) are looked up in its own
earlier text (prompt and output); what followed their most recent earlier occurrence is
proposed. It costs no model: code, quotes, lists and summaries repeat their input often. When
that continuation reaches the end of the text (the occurrence is recent: the text is repeating
itself with a short period), it goes on with the same period, so a loop is proposed k tokens
deep rather than up to the end.

Each sequence keeps an index per n from an n-gram to the latest position it started at (with
at least one token after it), grown as tokens are appended, so a lookup is a dictionary probe
whatever the context length.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from splitfuse.engine.sequence import Sequence


class NgramIndex:
    """n-gram -> latest start, for every n in [ngram_min, ngram_max], over one token list."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # tokens seen so far

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        before, now = self._indexed, len(tokens)
        for n, starts in self._starts.items():
            # Starts i with a token after the n-gram: i + n <= now - 1; new since: i + n > before - 1.
            for i in range(max(0, before - n), now - n):
                starts[tuple(tokens[i : i + n])] = i
        self._indexed = now

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix found, up to
        `max_tokens` tokens (continued with the same period past the end); [] when no suffix
        occurs earlier."""
        length = len(tokens)
        for n in self.sizes:
            if length <= n:
                continue
            start = self._starts[n].get(tuple(tokens[length - n :]))
            if start is not None:
                out: list[int] = []
                for pos in range(start + n, start + n + max_tokens):
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return out
        return []


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        # Weak keys: a finished sequence's index goes with it.
        self._indexes: WeakKeyDictionary[Sequence, NgramIndex] = WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        proposals = []
        for seq, limit in zip(seqs, max_tokens):
            index = self._indexes.get(seq)
            if index is None:
                index = self._indexes[seq] = NgramIndex(self.ngram_min, self.ngram_max)
            index.extend(seq.token_ids)
            proposals.append(index.propose(seq.token_ids, limit) if limit > 0 else [])
        return proposals

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)
