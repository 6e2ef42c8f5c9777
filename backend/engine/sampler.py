"""Batched token sampling: penalties, temperature, top-k/top-p, per-request seeds.

Row i of the logits belongs to seqs[i]. Processing order (per row, vectorised over the
batch): min_tokens masking, repetition penalty, presence/frequency penalties,
temperature, top-k, top-p, then sampling.

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d.
picks token j with probability probs[j]. The noise for a seeded request comes from a
generator seeded with (seed, output index), so its draws do not depend on the rest of
the batch or on earlier steps; unseeded rows share one sampler-level generator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain

import torch

from splitfuse.engine.sequence import SamplingParams, Sequence, TopLogprobs

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

SampledToken = tuple[int, float | None, TopLogprobs | None]
"""What one sampling row yields: the token, its log-prob and its top alternatives (each None
unless the request asks for it)."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    """Log-prob of each chosen token under the raw logits; None where not asked for."""
    top_logprobs: list[TopLogprobs | None]
    """Per row, its `params.top_logprobs` most likely (token, log-prob) pairs under the same
    distribution as `logprobs`, most likely first; None where not asked for."""
    scores: torch.Tensor | None = None
    """[rows, V]: per row, the values whose argmax is its token (a greedy row's processed logits, a
    sampled row's probs / noise; the logits themselves on the all-greedy path: read, never write).
    A row's token under a mask is the argmax of its masked scores: the token it would have drawn
    had it been masked before sampling (structured outputs mask only the rows that need it)."""


def _needs_processing(seq: Sequence) -> bool:
    """Anything besides a plain argmax for this row?"""
    p = seq.params
    return (
        p.temperature != 0.0
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or (p.min_tokens > 0 and seq.num_output_tokens < p.min_tokens)
    )


def derive_seed(seed: int, index: int) -> int:
    """Mix (seed, output index) into one 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int], default_seed: int = 0) -> None:
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.default_seed = default_seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs), V], got {tuple(logits.shape)} for {len(seqs)} seqs")
        if not seqs:
            return SamplerOutput([], [], [])
        if not any(_needs_processing(s) for s in seqs):
            # Hot path: all greedy, nothing to mask or penalise.
            scores = logits
        else:
            scores = self._scores(logits, seqs)
        tokens = scores.argmax(dim=-1)
        logprobs, top_logprobs = self._logprobs(logits, seqs, tokens)
        return SamplerOutput(tokens.tolist(), logprobs, top_logprobs, scores)

    # -- logit processing ------------------------------------------------------------

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 copy of `logits` after every processing step, before sampling.

        Greedy rows get masking and penalties only (temperature, top-k and top-p do not
        move their argmax). Removed tokens are -inf.
        """
        x = logits.to(torch.float32, copy=True)
        self._mask_min_tokens(x, seqs)
        self._apply_repetition_penalty(x, seqs)
        self._apply_presence_frequency(x, seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=x.device)
            params = [seqs[i].params for i in sampled]
            x[rows] = _truncate(x[rows], params)
        return x

    def _mask_min_tokens(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        vocab = x.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if p.min_tokens > 0 and s.num_output_tokens < p.min_tokens:
                ids = {t for t in chain(self.eos_token_ids, p.stop_token_ids) if t < vocab}
                rows.extend([i] * len(ids))
                cols.extend(ids)
        if rows:
            x[_idx(rows, x), _idx(cols, x)] = float("-inf")

    def _apply_repetition_penalty(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        """HF semantics over prompt + output tokens: divide positive, multiply negative."""
        picked = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if not picked:
            return
        local, cols = _flatten([seqs[i].token_ids for i in picked], x)
        rows = _idx(picked, x)[local]
        penalty = torch.tensor([seqs[i].params.repetition_penalty for i in picked], device=x.device)[local]
        vals = x[rows, cols]
        # Repeated tokens give duplicate (row, col) pairs that all write the same value,
        # so each token is penalised once however often it occurred.
        x[rows, cols] = torch.where(vals < 0, vals * penalty, vals / penalty)

    def _apply_presence_frequency(self, x: torch.Tensor, seqs: list[Sequence]) -> None:
        """OpenAI semantics over output tokens: logit -= presence*(count>0) + frequency*count."""
        picked = [
            i for i, s in enumerate(seqs)
            if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0) and s.num_output_tokens
        ]
        if not picked:
            return
        local, cols = _flatten([seqs[i].output_token_ids for i in picked], x)
        counts = torch.zeros(len(picked), x.shape[1], device=x.device)
        counts.index_put_((local, cols), torch.ones_like(cols, dtype=counts.dtype), accumulate=True)
        presence = torch.tensor([seqs[i].params.presence_penalty for i in picked], device=x.device)
        frequency = torch.tensor([seqs[i].params.frequency_penalty for i in picked], device=x.device)
        rows = _idx(picked, x)
        x[rows] -= presence[:, None] * (counts > 0) + frequency[:, None] * counts

    # -- sampling --------------------------------------------------------------------

    def _scores(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Per row, the values whose argmax is the row's token (SamplerOutput.scores)."""
        x = self.process_logits(logits, seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return x
        probs = torch.softmax(x[_idx(sampled, x)], dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled) if seqs[i].params.seed is None]
        if unseeded:
            shared = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise[_idx(unseeded, probs)] = shared.exponential_(generator=self._generator(probs.device))
        for j, i in enumerate(sampled):
            seq = seqs[i]
            if seq.params.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(derive_seed(seq.params.seed, seq.num_output_tokens))
                noise[j].exponential_(generator=gen)
        # Exp(1) can round to 0; keep the division finite.
        x[_idx(sampled, x)] = probs / noise.clamp_min_(1e-20)
        return x

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.default_seed)
            self._generators[device] = gen
        return gen

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence],
                  tokens: torch.Tensor) -> tuple[list[float | None], list[TopLogprobs | None]]:
        """The chosen tokens' log-probs and the top-k alternatives, for the rows that ask.

        Both are read from one log_softmax of the logits as given (before penalties,
        temperature and truncation: the model's distribution). A constrained row's logits
        arrive already masked by its grammar, so the tokens it disallows have log-prob -inf:
        a top-k wider than what the grammar allows lists some of them, with -inf.
        """
        out: list[float | None] = [None] * len(seqs)
        top: list[TopLogprobs | None] = [None] * len(seqs)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs or s.params.top_logprobs]
        if not wanted:
            return out, top
        rows = _idx(wanted, logits)
        logp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = logp.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
        for i, lp in zip(wanted, chosen):
            if seqs[i].params.logprobs:
                out[i] = lp
        ranked = [(j, i) for j, i in enumerate(wanted) if seqs[i].params.top_logprobs]
        if ranked:
            # One topk for every row that asks, at the widest k; each row keeps its own k.
            ks = [min(seqs[i].params.top_logprobs, logp.shape[1]) for _, i in ranked]
            values, ids = logp[_idx([j for j, _ in ranked], logp)].topk(max(ks), dim=-1)
            for (_, i), k, row_ids, row_values in zip(ranked, ks, ids.tolist(), values.tolist()):
                top[i] = list(zip(row_ids[:k], row_values[:k]))
        return out, top


def sample_isolated(sample: Callable[[torch.Tensor, list], SamplerOutput], logits: torch.Tensor,
                    seqs: list) -> tuple[list[SampledToken | Exception], list]:
    """Per row: (token, log-prob, top log-probs), or what sampling that row raised; and per row
    its scores (SamplerOutput.scores; None for a row that raised).

    The batch is sampled in one call; only when that raises is each row sampled alone, so that
    a failure tied to one request (its parameters, its logits) fails that request and not the
    batch. Seeded rows draw the same tokens either way (their noise depends on seed and
    position only)."""
    try:
        out = sample(logits, seqs)
        return list(zip(out.token_ids, out.logprobs, out.top_logprobs)), out.scores
    except Exception:
        log.exception("sampling a batch of %d failed; sampling each request alone", len(seqs))
    rows: list[SampledToken | Exception] = []
    scores: list = []
    for i, seq in enumerate(seqs):
        try:
            out = sample(logits[i : i + 1], [seq])
            rows.append((out.token_ids[0], out.logprobs[0], out.top_logprobs[0]))
            scores.append(out.scores[0])
        except Exception as e:
            rows.append(e)
            scores.append(None)
    return rows, scores


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p for sampled rows (all temperatures > 0)."""
    device = x.device
    vocab = x.shape[1]
    x = x / torch.tensor([p.temperature for p in params], device=device)[:, None]
    ks = [min(p.top_k, vocab) for p in params]
    kmax = max(ks)
    if kmax > 0:
        # Threshold at each row's k-th largest value; rows with top_k=0 keep everything.
        top = x.topk(kmax, dim=-1).values
        k = torch.tensor(ks, device=device)
        kth = top.gather(1, (k.clamp_min(1) - 1)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest set of top tokens whose mass reaches top_p (always the best one).
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _idx(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _flatten(token_lists: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of the list, token) for every token, dropping ids outside the vocab."""
    lengths = torch.tensor([len(t) for t in token_lists])
    local = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    cols = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    keep = cols < like.shape[1]
    return local[keep].to(like.device), cols[keep].to(like.device)
