"""Compiling guides into token-level grammars (xgrammar) and following them while decoding.

A guide is compiled once per text for the engine's tokenizer, in a child process bounded in time
and memory (compile_worker.py), asked for by `LLMEngine.prepare_prompt` on the caller's thread,
which waits, so the engine thread finds it compiled. Each constrained sequence gets a matcher:
before sampling, its row of logits is masked to the tokens the grammar allows next; after
sampling, the matcher accepts the token (matcher.py, which also checks speculative proposals).
A preempted sequence keeps its matcher, as its tokens do not change when they are recomputed.
A guide that failed is remembered (the last MAX_FAILED_GUIDES, by text): sending it again is
refused at once, not compiled again, so a guide that crashes the compiler cannot be used to keep
restarting it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from splitfuse.structured.compile_worker import CompilerUnavailable, CompileWorker
from splitfuse.structured.guide import Guide
from splitfuse.structured.matcher import Matcher, apply_bitmask_, new_bitmask

MAX_FAILED_GUIDES = 1024


class GrammarCache:
    """Compiled grammars for one tokenizer and vocabulary, by guide."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError as e:  # an optional dependency: only constrained requests need it
            raise ValueError(f"structured outputs need the xgrammar package ({e})") from None
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._info = info
        self._worker = CompileWorker(info)  # its process starts at the first compile
        # xgrammar's JSON grammars let a string hold raw control characters (bytes below 0x20),
        # which JSON forbids (json.loads refuses them): tokens holding one are masked out of
        # JSON outputs; between values only the whitespace JSON allows may appear.
        vocab = info.decoded_vocab
        control = [any(b < 0x20 for b in token) for token in vocab]
        not_json_space = [any(b < 0x20 and b not in (0x09, 0x0A, 0x0D) for b in token) for token in vocab]
        specials = set(info.special_token_ids) | set(info.stop_token_ids)
        self._keep_no_control = _keep_words([c and i not in specials for i, c in enumerate(control)], vocab_size)
        self._keep_json_space = _keep_words([c and i not in specials for i, c in enumerate(not_json_space)], vocab_size)
        self._compiled: dict[Guide, Any] = {}
        self._compiling: dict[Guide, Future] = {}
        self._failed: OrderedDict[Guide, str] = OrderedDict()  # guide -> its error, oldest first
        self._lock = threading.Lock()

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of `guide`; ValueError naming the problem when it does not compile.
        A guide already compiling for another request is waited for, not compiled again."""
        with self._lock:
            found = self._compiled.get(guide)
            if found is not None:
                return found
            error = self._failed.get(guide)
            if error is not None:
                self._failed.move_to_end(guide)
                raise ValueError(error)
            future = self._compiling.get(guide)
            if future is None:
                future = self._compiling[guide] = self._worker.submit(guide.kind, guide.text)
        try:
            compiled = future.result()
        except ValueError as e:  # a fresh exception per waiter: they may raise it at once
            self._settle(guide, future, None, None if isinstance(e, CompilerUnavailable) else str(e))
            raise ValueError(str(e)) from None
        self._settle(guide, future, compiled)
        return compiled

    def _settle(self, guide: Guide, future: Future, compiled: Any, error: str | None = None) -> None:
        # One step under the lock: the guide is never neither compiling nor cached in between.
        with self._lock:
            if self._compiling.get(guide) is future:
                del self._compiling[guide]
            if compiled is not None:
                self._compiled[guide] = compiled
            elif error is not None:
                self._failed[guide] = error
                while len(self._failed) > MAX_FAILED_GUIDES:
                    self._failed.popitem(last=False)

    @property
    def num_compiles(self) -> int:
        """Guides sent to the compiler process so far (cache hits and remembered failures not)."""
        return self._worker.requests

    def close(self) -> None:
        """Stop the compiler process (it also stops when this cache is dropped)."""
        self._worker.close()

    def matcher(self, guide: Guide) -> Matcher:
        keep = {"json_schema": self._keep_no_control, "json": self._keep_json_space}.get(guide.kind)
        return Matcher(self._xgr, self.compile(guide), self.vocab_size, keep)

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        """A step's bitmask for `num_rows` logits rows (matchers fill theirs)."""
        return new_bitmask(self._xgr, num_rows, self.vocab_size)

    def apply_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask_(self._xgr, logits, bitmask, rows, self.vocab_size)


def _keep_words(forbidden: list[bool], vocab_size: int) -> torch.Tensor:
    """int32 bitmask words (32 tokens each, lowest bit first, as xgrammar's) with the bits of the
    `forbidden` tokens cleared and every other bit set."""
    bits = np.ones(-(-vocab_size // 32) * 32, dtype=bool)
    bits[: len(forbidden)] &= ~np.asarray(forbidden, dtype=bool)
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())
