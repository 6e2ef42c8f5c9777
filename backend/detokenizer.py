"""Incremental detokenization with stop strings.

Each step decodes only a small window of token ids (vLLM-style prefix/read offsets):

    ids:  ... committed ... | prefix_offset ... | read_offset ... pending ... |
                              `-- context --'     `-- new tokens -----------'

The text of the new tokens is ``decode(ids[prefix:]) minus decode(ids[prefix:read])``.
Decoding from one token before `read_offset` keeps decoders that strip a leading
space from the first token (sentencepiece ``▁``) from eating real spaces.

Byte exactness relies on both offsets sitting at *exact cuts*: token boundaries where
the decoder restarts cleanly, so decoding the two sides separately gives the same
text as decoding them together. We only cut

* after a window whose text ends in a complete character (not U+FFFD), or
* before a token whose own text does not start with U+FFFD, i.e. whose first byte is
  not a UTF-8 continuation byte (UTF-8 decoding resynchronises on such a byte).

New text that ends in U+FFFD may be an incomplete multi-byte character, so it is held
back until a later token completes it or the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitfuse.sequence import SamplingParams

_REPLACEMENT = "\ufffd"
# Pending tokens we tolerate behind an unfinished character before looking for an
# earlier exact cut; a real character spans at most 4 byte tokens.
_MAX_PENDING = 6
# How far back from read_offset the context window may reach after a big commit.
_MAX_CONTEXT = 4


@dataclass
class DetokenizerStep:
    delta_text: str
    stop_matched: bool
    """A stop string was found; the engine finishes the request with reason "stop"."""


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, one engine step at a time."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        # The Rust tokenizer decodes ~3x faster than the HF wrapper; it gives the same text
        # unless the wrapper post-processes spaces (clean_up_tokenization_spaces).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast_decode = (
            backend.decode if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
            else None
        )
        self._skip_special = params.skip_special_tokens
        self._stop = [s for s in params.stop if s]
        # Enough trailing text to hide the start of the longest stop string.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        # Tokens the decoder drops anyway; filtering them up front keeps windows small
        # and keeps "every token contributes at least one byte" true for cut search.
        self._skipped_ids: frozenset[int] = (
            frozenset(_special_ids(tokenizer)) if self._skip_special else frozenset()
        )
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._unemitted = ""  # decoded text held back for stop-string matching
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self._done = False

    @property
    def text(self) -> str:
        """Everything emitted so far (the join of all deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def step(self, new_token_ids: list[int], finished: bool) -> DetokenizerStep:
        if self._done:  # already stopped or finished: nothing more is emitted
            return DetokenizerStep("", False)
        skipped = self._skipped_ids
        self._ids.extend(t for t in new_token_ids if t not in skipped)
        new_text = self._decode_committable(finished)
        if finished:
            self._done = True
        if not new_text and not finished:
            return DetokenizerStep("", False)

        candidate = self._unemitted + new_text
        match = self._find_stop(candidate)
        if match is not None:
            self._done = True
            self._unemitted = ""
            return DetokenizerStep(self._emit(candidate[:match]), True)
        if finished:
            self._unemitted = ""
            return DetokenizerStep(self._emit(candidate), False)
        keep = min(self._holdback, len(candidate))
        self._unemitted = candidate[len(candidate) - keep :]
        return DetokenizerStep(self._emit(candidate[: len(candidate) - keep]), False)

    # -- internals -------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_committable(self, finished: bool) -> str:
        """Text of pending tokens that is final; advances the offsets past it."""
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return ""
        prefix_text = self._decode(ids[prefix:read])
        full_text = self._decode(ids[prefix:])
        new_text = full_text[len(prefix_text) :]
        if finished or not new_text.endswith(_REPLACEMENT):
            self._advance(len(ids))
            return new_text
        # Possibly an unfinished character: wait for more tokens. If many tokens piled
        # up (a run of invalid bytes), commit up to the latest exact cut so the window
        # stays small; the bytes before it can no longer change.
        if len(ids) - read <= _MAX_PENDING:
            return ""
        for cut in range(len(ids) - 1, read, -1):
            head = self._decode(ids[prefix:cut])
            # Exact if the text before ends in a whole character or the token after
            # starts a new one.
            if not head.endswith(_REPLACEMENT) or self._starts_cleanly(cut):
                self._advance(cut)
                return head[len(prefix_text) :]
        return ""

    def _advance(self, new_read: int) -> None:
        """Commit tokens up to `new_read` (an exact cut) and pick the next context start."""
        old_read = self._read_offset
        prefix = old_read
        # After a big commit, start the context closer to new_read if a cut exists there.
        for cut in range(new_read - 1, max(old_read, new_read - _MAX_CONTEXT - 1), -1):
            if self._starts_cleanly(cut):
                prefix = cut
                break
        self._prefix_offset = prefix
        self._read_offset = new_read

    def _starts_cleanly(self, index: int) -> bool:
        """Is the boundary before token `index` an exact cut?"""
        text = self._decode([self._ids[index]])
        return bool(text) and not text.startswith(_REPLACEMENT)

    def _find_stop(self, text: str) -> int | None:
        """Start of the stop string that completes first in `text` (ties: earliest start).

        Ordering by end position makes the result independent of how the text was
        split into steps, so streaming and one-shot decoding agree.
        """
        best: tuple[int, int] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta


def _special_ids(tokenizer) -> set[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:  # fast tokenizers skip exactly the added tokens flagged special
        return {i for i, tok in added.items() if getattr(tok, "special", False)}
    return set(getattr(tokenizer, "all_special_ids", ()))
