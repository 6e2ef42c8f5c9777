"""The RequestOutput a step hands out for one request: its new tokens and text, and a view of
everything so far (read from the sequence and its detokenizer, not copied)."""

from __future__ import annotations

from splitfuse.engine.detokenizer import IncrementalDetokenizer
from splitfuse.engine.sequence import FinishReason, RequestOutput, Sequence


def request_output(seq: Sequence, new_tokens: list[int], delta_text: str, reason: FinishReason | None,
                   detokenizer: IncrementalDetokenizer) -> RequestOutput:
    """`seq`'s output for a step that appended `new_tokens` (text `delta_text`); final when
    `reason` is given."""
    want_logprobs = seq.params.logprobs
    want_top = seq.params.top_logprobs > 0
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        delta_token_ids=new_tokens,
        delta_text=delta_text,
        finished=reason is not None,
        finish_reason=reason.value if reason is not None else None,
        delta_logprobs=seq.output_logprobs[-len(new_tokens):] if want_logprobs and new_tokens else None,
        delta_top_logprobs=seq.output_top_logprobs[-len(new_tokens):] if want_top and new_tokens else None,
        seq_token_ids=seq.token_ids,
        num_tokens=len(seq.token_ids),
        seq_logprobs=seq.output_logprobs if want_logprobs else None,
        seq_top_logprobs=seq.output_top_logprobs if want_top else None,
        text_source=detokenizer,
        text_len=detokenizer.text_length,
        num_cached_tokens=seq.num_cached_tokens or 0,
    )


def error_output(seq: Sequence, error: str) -> RequestOutput:
    """The final output of `seq`, failed with `error`: no text (its detokenizer may be what
    failed)."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        delta_token_ids=[],
        delta_text="",
        finished=True,
        finish_reason=FinishReason.ERROR.value,
        seq_token_ids=seq.token_ids,
        num_tokens=len(seq.token_ids),
        error=error,
    )
