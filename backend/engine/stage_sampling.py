"""Sampling on the last pipeline stage.

Rank 0 keeps what a request's sampling depends on across steps (the sequences, grammar matchers,
speculation's proposals); each micro-batch carries what the sampler reads of its sampling rows
(`RowSpec`) and their grammar masks, filled on rank 0 before the forward pass. The last stage
samples as soon as its logits exist and sends back, per row, the token, its log-prob and its top
log-probs: rows x (2 + 2K) numbers instead of rows x vocabulary logits.

Every constrained row is masked before it is sampled here (on a single stage most are sampled
first and masked only when refused): the same tokens, as masks only remove competitors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from splitfuse.engine.sampler import SampledToken, Sampler, sample_isolated
from splitfuse.engine.sequence import SamplingParams
from splitfuse.structured.masking import GrammarStepError
from splitfuse.structured.matcher import apply_bitmask_

if TYPE_CHECKING:
    from splitfuse.engine.scheduler import ScheduledChunk
    from splitfuse.structured.masking import GrammarMasking

_FAILED = -1.0
"""A reply row's token when sampling that row raised on the last stage."""


@dataclass
class RowSpec:
    """One sampling row as the sampler reads it (a Sequence's or a DraftPrefix's fields); token
    lists only where a penalty reads them."""

    params: SamplingParams
    num_output_tokens: int
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, row: Any) -> "RowSpec":
        p = row.params
        if p.guide is not None or p.stop:
            p = replace(p, guide=None, stop=[])  # text-side fields: rank 0's
        return cls(p, row.num_output_tokens,
                   list(row.token_ids) if p.repetition_penalty != 1.0 else [],
                   list(row.output_token_ids) if p.presence_penalty or p.frequency_penalty else [])


@dataclass
class StageSampling:
    """A micro-batch's sampling rows, for the last stage to sample."""

    rows: list[RowSpec]
    eos_token_ids: tuple[int, ...]
    bitmask: torch.Tensor | None = None
    """int32 grammar bitmask words [rows, words] (xgrammar's layout); None without constrained rows."""
    masked_rows: list[int] = field(default_factory=list)
    """The rows of `bitmask` that were filled."""
    grammar_vocab_size: int = 0
    grammar_errors: dict[int, str] = field(default_factory=dict)
    """Rows whose grammar failed on rank 0 (sampled anyway; rank 0 ends their requests)."""

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], rows: list[Any], masking: GrammarMasking,
              eos_token_ids: list[int]) -> "StageSampling":
        """On rank 0: the sampling `chunks`' `rows` (spec_decode's sampling_rows), with every
        constrained row's grammar mask filled here, where the matchers are."""
        failed: dict[int, Exception] = {}
        bitmask, masked = None, []
        if masking.active:
            bitmask, masked, _ = masking.fill(chunks, len(rows), failed, every=True)
        return cls([RowSpec.of(r) for r in rows], tuple(eos_token_ids), bitmask, masked, masking.vocab_size,
                   {r: str(e) for r, e in failed.items()})

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def top_k(self) -> int:
        return max((r.params.top_logprobs for r in self.rows), default=0)

    @property
    def reply_width(self) -> int:
        """Columns of the reply: token, log-prob, then top_k (token, log-prob) pairs."""
        return 2 + 2 * self.top_k

    def sample(self, sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
        """On the last stage: mask, sample and encode the rows (float64 [rows, reply_width]; token
        ids are exact in float64)."""
        if self.masked_rows:
            apply_bitmask_(_xgrammar(), logits, self.bitmask.to(logits.device), self.masked_rows,
                           self.grammar_vocab_size)
        sampled, _ = sample_isolated(sampler, logits, self.rows)
        width = self.reply_width
        reply = []
        for row in sampled:
            values = [math.nan] * width
            if isinstance(row, Exception):
                values[0] = _FAILED
            else:
                token, logprob, top = row
                values[0] = token
                if logprob is not None:
                    values[1] = logprob
                for j, pair in enumerate(top or []):
                    values[2 + 2 * j : 4 + 2 * j] = pair
            reply.append(values)
        return torch.tensor(reply, dtype=torch.float64, device=logits.device).reshape(self.num_rows, width)

    def decode(self, reply: torch.Tensor, stage: int) -> list[SampledToken | Exception]:
        """On rank 0: the rows' tokens from the last stage's `reply`; a grammar's failure or a
        failed sampling as the row's exception."""
        out: list[SampledToken | Exception] = []
        for i, (values, spec) in enumerate(zip(reply.tolist(), self.rows)):
            if i in self.grammar_errors:
                out.append(GrammarStepError(self.grammar_errors[i]))
            elif values[0] == _FAILED:
                out.append(RuntimeError(f"sampling this request failed on pipeline stage {stage} (see its log)"))
            else:
                # Fewer pairs than asked (NaN) where the vocabulary is smaller.
                top = [(int(values[2 + 2 * j]), values[3 + 2 * j]) for j in range(spec.params.top_logprobs)
                       if not math.isnan(values[2 + 2 * j])] if spec.params.top_logprobs else None
                out.append((int(values[0]), values[1] if spec.params.logprobs else None, top))
        return out


def _xgrammar() -> Any:
    import xgrammar  # only where a constrained row is sampled

    return xgrammar
