"""Incremental detokenization with stop strings.

Each step decodes only a small window of token ids (vLLM-style prefix/read offsets):

    ids:  ... committed ... | prefix_offset ... | read_offset ... pending ... |
                              `-- context --'     `-- new tokens -----------'

The text of the new tokens is ``decode(ids[prefix:]) minus decode(ids[prefix:read])``.
Decoding from one token before `read_offset` keeps decoders that strip a leading
space from the first token (sentencepiece ``▁``) from eating real spaces. For the same
reason the first window starts at the prompt's last tokens: the output's text is then
``decode(prompt + output)`` minus ``decode(prompt)``, and the first output token keeps its
space, as the peers' servers give it (vLLM, TGI).

Byte exactness relies on both offsets sitting at *exact cuts*: token boundaries where
the decoder restarts cleanly, so decoding the two sides separately gives the same
text as decoding them together. We only cut

* after a window whose text ends in a complete character (not U+FFFD), or
* before a token whose own text does not start with U+FFFD, i.e. whose first byte is
  not a UTF-8 continuation byte (UTF-8 decoding resynchronises on such a byte).

New text that ends in U+FFFD may be an incomplete multi-byte character, so it is held
back until a later token completes it or the request finishes.

Fast path: byte-level BPE tokenizers (GPT-2 style, as in Llama 3 and Qwen2) decode by
concatenating each token's fixed bytes and decoding UTF-8 with U+FFFD for bad bytes. For
them a per-token byte table replaces the decoder calls: bytes are cut only at token
boundaries after a complete UTF-8 sequence, where decoding resynchronises, so the result
is the same text. The table is checked against the real decoder when it is built, and a
request that meets an added token (whose text is not bytes of the table) goes on with the
decoder from its last cut.
"""

from __future__ import annotations

import logging
import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from splitfuse.engine.sequence import SamplingParams

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Pending tokens we tolerate behind an unfinished character before looking for an
# earlier exact cut; a real character spans at most 4 byte tokens.
_MAX_PENDING = 6
# How far back from read_offset the context window may reach after a big commit.
_MAX_CONTEXT = 4
# Prompt tokens searched for the first window's context (a character spans at most 4 byte tokens).
_PROMPT_CONTEXT = 8


@dataclass
class DetokenizerStep:
    delta_text: str
    stop_matched: bool
    """A stop string was found; the engine finishes the request with reason "stop"."""


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, one engine step at a time."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
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
        self._byte_table = byte_level_table(tokenizer)
        self._pending = bytearray()  # fast path: bytes of tokens ids[read_offset:]
        self._pending_ends: list[int] = []  # end of each pending token's bytes in _pending
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._unemitted = ""  # decoded text held back for stop-string matching
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self.text_length = 0  # len(self.text), kept without joining
        self._done = False
        if self._byte_table is None:  # byte-level tokens decode alike with or without context
            self._start_after_prompt(prompt_ids)

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
        if skipped:
            self._ids.extend(t for t in new_token_ids if t not in skipped)
        else:
            self._ids.extend(new_token_ids)
        new_text = self._decode_committable(finished)
        if finished:
            self._done = True
        if not new_text and not finished:
            return DetokenizerStep("", False)
        if not self._stop:  # nothing to match or hold back
            return DetokenizerStep(self._emit(new_text), False)

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

    def _start_after_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Take the prompt's last tokens as the first window's context: the fewest whose text
        starts and ends with whole characters (exact cuts on both sides); none where the
        prompt ends inside a character."""
        tail = [t for t in prompt_ids[-_PROMPT_CONTEXT:] if t not in self._skipped_ids]
        for start in range(len(tail) - 1, -1, -1):
            text = self._decode(tail[start:])
            if not text or text.startswith(_REPLACEMENT):
                continue  # starts inside a character (or decodes to nothing): reach further back
            if not text.endswith(_REPLACEMENT):
                self._ids = tail[start:]
                self._prefix_offset = 0
                self._read_offset = len(self._ids)
            return

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_committable(self, finished: bool) -> str:
        """Text of pending tokens that is final; advances the offsets past it."""
        if self._byte_table is not None:
            text = self._decode_bytes(finished)
            if text is not None:
                return text
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

    def _decode_bytes(self, finished: bool) -> str | None:
        """Fast path; None once an id has no table entry (the decoder takes over from here)."""
        table, ids, ends = self._byte_table, self._ids, self._pending_ends
        first_new = self._read_offset + len(ends)
        if first_new == len(ids) - 1 and not ends:
            # The common step: one new token and nothing pending.
            b = table[ids[-1]] if ids[-1] < len(table) else None
            if b is not None and (b[-1] < 0x80 or finished or _utf8_complete(b, len(b))):
                self._read_offset = self._prefix_offset = len(ids)
                return b.decode("utf-8", errors="replace")
        new = ids[first_new:]
        if any(i >= len(table) or table[i] is None for i in new):
            # Tokens before read_offset end at a complete character: an exact cut.
            self._byte_table = None
            self._prefix_offset = self._read_offset
            self._pending.clear()
            ends.clear()
            return None
        buf = self._pending
        for i in new:
            buf += table[i]
            ends.append(len(buf))
        if not ends:
            return ""
        # The last pending token after which the bytes end in a complete UTF-8 sequence.
        count = len(ends)
        if not finished:
            while count and not _utf8_complete(buf, ends[count - 1]):
                count -= 1
            if count == 0:
                return ""
        end = ends[count - 1]
        text = buf[:end].decode("utf-8", errors="replace")
        del buf[:end]
        self._pending_ends = [e - end for e in ends[count:]]
        self._read_offset += count
        self._prefix_offset = self._read_offset
        return text

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
            self.text_length += len(delta)
        return delta


def _special_ids(tokenizer) -> set[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:  # fast tokenizers skip exactly the added tokens flagged special
        return {i for i, tok in added.items() if getattr(tok, "special", False)}
    return set(getattr(tokenizer, "all_special_ids", ()))


def _utf8_complete(buf: bytes | bytearray, end: int) -> bool:
    """Do the bytes before `end` end where UTF-8 decoding restarts, whatever follows?

    They do unless they end inside a multi-byte sequence that later bytes could still
    complete (or turn invalid): a lead byte followed by fewer continuation bytes than it
    announces. Holding back too much is harmless; cutting too early is not.
    """
    i, continuation = end - 1, 0
    while i >= 0 and continuation < 4 and buf[i] & 0xC0 == 0x80:
        i -= 1
        continuation += 1
    if i < 0 or continuation == 4:
        return True
    lead = buf[i]
    need = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF8 else 1
    return continuation + 1 >= need


# tokenizer -> its byte table (None when the fast path does not apply); built once per tokenizer.
_BYTE_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def byte_level_table(tokenizer) -> list[bytes | None] | None:
    """Bytes of every regular token id of a byte-level BPE tokenizer, or None."""
    try:
        return _BYTE_TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _build_byte_table(tokenizer)
    try:
        _BYTE_TABLES[tokenizer] = table
    except TypeError:  # not weak-referenceable: build per request
        pass
    return table


def _gpt2_byte_chars() -> dict[str, int]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _build_byte_table(tokenizer) -> list[bytes | None] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    char_to_byte = _gpt2_byte_chars()
    vocab = backend.get_vocab(with_added_tokens=False)
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if i in added:
            continue
        try:
            table[i] = bytes(char_to_byte[c] for c in token)
        except KeyError:
            return None
    # Check against the real decoder on random sequences biased to multi-byte tokens.
    regular = [i for i, b in enumerate(table) if b is not None]
    multibyte = [i for i in regular if max(table[i], default=0) >= 0x80] or regular
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(multibyte if rng.random() < 0.7 else regular) for _ in range(rng.randint(1, 8))]
        ours = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        if ours != backend.decode(ids, skip_special_tokens=False):
            log.info("detokenizer: byte table disagrees with the tokenizer's decoder; not used")
            return None
    return table
