"""OpenAI's log-probability objects, from the `llm` model's per-token values.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]}`.
Completions (legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}, ...] | None,
text_offset}`, where each top_logprobs dict also holds the sampled token (so up to k + 1
entries), as OpenAI's did. Alternatives come most likely first.

A token the sampler could not pick (masked by a grammar or top_k) has log-probability -inf,
which JSON cannot carry: it reads -9999.0, as in OpenAI's and vLLM's answers.

Each token's entries are built once, when its step arrives (ChatLogprobs / CompletionLogprobs
append them): the whole answer reuses the streamed steps' entries, so the work and memory grow
with the tokens, never with tokens x steps. `check_budget` bounds them before a request starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitfuse.openai_api.protocol import ApiError

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


def entries(n: int, max_tokens: int, top_logprobs: int) -> int:
    """Log-probability entries a request may build: per token of each choice, the sampled one
    and its alternatives."""
    return n * max_tokens * (top_logprobs + 1)


def check_budget(n: int, max_tokens: int, top_logprobs: int, limit: int, param: str) -> None:
    """400 naming the limit when a request asking for log-probs could build more than `limit`
    entries (ApiConfig.max_logprob_entries)."""
    wanted = entries(n, max_tokens, top_logprobs)
    if wanted > limit:
        raise ApiError(400, f"n ({n}) x max_tokens ({max_tokens}) x (top_logprobs ({top_logprobs}) + 1) = {wanted} "
                            f"log-probability entries, over this server's limit of {limit} "
                            f"(--max-logprob-entries): lower max_tokens, n or {param}",
                       param=param, code="logprobs_limit_exceeded")


@dataclass
class ChatLogprobs:
    """A chat choice's `logprobs.content`, appended step by step."""

    content: list[dict] = field(default_factory=list)

    def add(self, lp: TokenLogprobs, strings: TokenStrings) -> dict:
        """This step's object (its entries are also kept for the whole answer)."""
        step = chat_logprobs(lp, strings)
        self.content.extend(step["content"])
        return step

    def whole(self) -> dict:
        return {"content": self.content}


@dataclass
class CompletionLogprobs:
    """A completion choice's legacy log-probs, appended step by step."""

    want_top: bool
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, lp: TokenLogprobs, strings: TokenStrings, text_start: int) -> dict:
        """This step's object, its offsets from `text_start` (also kept for the whole answer)."""
        step = completion_logprobs(lp, strings, text_start, self.want_top)
        self.tokens.extend(step["tokens"])
        self.token_logprobs.extend(step["token_logprobs"])
        self.top_logprobs.extend(step["top_logprobs"] or ())
        self.text_offset.extend(step["text_offset"])
        return step

    def whole(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs if self.want_top else None, "text_offset": self.text_offset}
