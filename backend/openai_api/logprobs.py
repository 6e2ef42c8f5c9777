"""OpenAI's log-probability objects, from the `llm` model's per-token values.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]}`.
Completions (legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}, ...] | None,
text_offset}`, where each top_logprobs dict also holds the sampled token (so up to k + 1
entries), as OpenAI's did. Alternatives come most likely first.

A token the sampler could not pick (masked by a grammar or top_k) has log-probability -inf,
which JSON cannot carry: it reads -9999.0, as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TokenStrings = Callable[[list[int]], list[str]]
# What -inf (and NaN) log-probabilities read as.
FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


@dataclass
class TokenLogprobs:
    """One response's tokens and their log-probabilities."""

    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def alternatives(self, i: int) -> list[tuple[int, float]]:
        """Token i's alternatives, most likely first (the order is kept among equals)."""
        if self.top_ids is None or self.top_logprobs is None:
            return []
        pairs = list(zip(self.top_ids[i], self.top_logprobs[i]))
        return sorted(pairs, key=lambda p: -p[1])


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(lp: TokenLogprobs, strings: TokenStrings) -> dict:
    tokens = strings(lp.ids)
    content = []
    for i, (token, value) in enumerate(zip(tokens, lp.logprobs)):
        alternatives = lp.alternatives(i)
        names = strings([t for t, _ in alternatives])
        content.append({**_entry(token, value),
                        "top_logprobs": [_entry(n, v) for n, (_, v) in zip(names, alternatives)]})
    return {"content": content}


def completion_logprobs(lp: TokenLogprobs, strings: TokenStrings, text_start: int, want_top: bool) -> dict:
    """Offsets count characters of the choice's text, from `text_start`."""
    tokens = strings(lp.ids)
    offsets, pos = [], text_start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if want_top:
        top = []
        for i, (token, value) in enumerate(zip(tokens, lp.logprobs)):
            alternatives = lp.alternatives(i)
            names = strings([t for t, _ in alternatives])
            row: dict[str, float] = {}
            for name, (_, v) in zip(names, alternatives):
                row.setdefault(name, _finite(v))  # two ids may read the same: the likelier one stays
            row.setdefault(token, _finite(value))
            top.append(row)
    return {"tokens": tokens, "token_logprobs": [_finite(v) for v in lp.logprobs], "top_logprobs": top,
            "text_offset": offsets}
