"""Compiling guides into token-level grammars (xgrammar) and following them while decoding.

A guide is compiled once per text for the engine's tokenizer, in a child process bounded in time
and memory (compile_worker.py), asked for by `LLMEngine.prepare_prompt` on the caller's thread,
which waits, so the engine thread finds it compiled. Each constrained sequence gets a matcher:
before sampling, its row of logits is masked to the tokens the grammar allows next; after
sampling, the matcher accepts the token (matcher.py, which also checks speculative proposals).
A preempted sequence keeps its matcher, as its tokens do not change when they are recomputed.
A guide that failed is remembered (the last MAX_FAILED_GUIDES, by its normalized text, see
`Guide.normalized`): sending it again, or a copy differing only in key order or whitespace, is
refused at once, not compiled again, so a guide that crashes or stalls the compiler cannot be used
to keep restarting it. Compiled grammars are kept up to a budget in bytes (xgrammar's
`memory_size_bytes`), the least recently used evicted first, so distinct schemas cannot grow the
process without bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from splitfuse.config import GrammarLimits
from splitfuse.errors import SERVER_BUSY, ServerBusyError
from splitfuse.structured.compile_worker import CompilerUnavailable, CompileWorker
from splitfuse.structured.guide import Guide
from splitfuse.structured.matcher import Matcher, apply_bitmask_, new_bitmask

MAX_FAILED_GUIDES = 1024


class GrammarCache:
    """Compiled grammars for one tokenizer and vocabulary, by guide."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits = GrammarLimits()) -> None:
        try:
            import xgrammar
        except ImportError as e:  # an optional dependency: only constrained requests need it
            raise ValueError(f"structured outputs need the xgrammar package ({e})") from None
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._info = info
        self._worker = CompileWorker(info, limits.compile_timeout_s)  # its process starts at the first compile
        # xgrammar's JSON grammars let a string hold raw control characters (bytes below 0x20),
        # which JSON forbids (json.loads refuses them): tokens holding one are masked out of
        # JSON outputs; between values only the whitespace JSON allows may appear.
        vocab = info.decoded_vocab
        control = [any(b < 0x20 for b in token) for token in vocab]
        not_json_space = [any(b < 0x20 and b not in (0x09, 0x0A, 0x0D) for b in token) for token in vocab]
        specials = set(info.special_token_ids) | set(info.stop_token_ids)
        self._keep_no_control = _keep_words([c and i not in specials for i, c in enumerate(control)], vocab_size)
        self._keep_json_space = _keep_words([c and i not in specials for i, c in enumerate(not_json_space)], vocab_size)
        self.max_bytes = limits.cache_bytes
        self.max_pending = limits.max_pending
        self._compiled: OrderedDict[Guide, tuple[Any, int]] = OrderedDict()  # -> (grammar, bytes), LRU first
        self._bytes = 0
        self._compiling: dict[Guide, Future] = {}
        self._failed: OrderedDict[Guide, str] = OrderedDict()  # guide -> its error, oldest first
        self._lock = threading.Lock()

    def compile_async(self, guide: Guide) -> Future:
        """A future of `guide`'s compiled grammar (ValueError naming the problem when it does
        not compile); done at once for a cached or remembered-failed guide. A guide already
        compiling for another request shares its compile. ServerBusyError when
        `max_pending` distinct guides already wait for the compiler (bounded work queued)."""
        with self._lock:
            found = self._compiled.get(guide)
            if found is not None:
                self._compiled.move_to_end(guide)
                return _done(found[0])
            error = self._failed.get(guide.normalized())
            if error is not None:
                self._failed.move_to_end(guide.normalized())
                return _done(error=ValueError(error))
            future = self._compiling.get(guide)
            if future is not None:
                return future
            if len(self._compiling) >= self.max_pending:
                raise ServerBusyError(f"{SERVER_BUSY}: {len(self._compiling)} guides are waiting to compile "
                                      f"(max_pending_guides={self.max_pending}); retry later")
            future = self._compiling[guide] = self._worker.submit(guide.kind, guide.text)
        future.add_done_callback(lambda f: self._settle(guide, f))
        return future

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of `guide`, waited for; ValueError naming the problem."""
        try:
            return self.compile_async(guide).result()
        except ValueError as e:  # a fresh exception per waiter: they may raise it at once
            raise ValueError(str(e)) from None

    def _settle(self, guide: Guide, future: Future) -> None:
        # One step under the lock: the guide is never neither compiling nor cached in between.
        error = future.exception()
        with self._lock:
            if self._compiling.get(guide) is future:
                del self._compiling[guide]
            if error is None:
                self._keep(guide, future.result())
            elif isinstance(error, ValueError) and not isinstance(error, CompilerUnavailable):
                self._failed[guide.normalized()] = str(error)
                while len(self._failed) > MAX_FAILED_GUIDES:
                    self._failed.popitem(last=False)

    def _keep(self, guide: Guide, compiled: Any) -> None:
        # Under the lock. A grammar larger than the whole budget is used but not kept.
        size = int(compiled.memory_size_bytes)
        if guide in self._compiled or size > self.max_bytes:
            return
        self._compiled[guide] = (compiled, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, evicted) = self._compiled.popitem(last=False)
            self._bytes -= evicted

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars kept (at most `max_bytes`)."""
        return self._bytes

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    @property
    def num_compiles(self) -> int:
        """Guides sent to the compiler process so far (cache hits and remembered failures not)."""
        return self._worker.requests

    def close(self) -> None:
        """Stop the compiler process (it also stops when this cache is dropped)."""
        self._worker.close()

    def matcher(self, guide: Guide, compiled: Any = None) -> Matcher:
        """A matcher at the start of `guide`'s grammar (`compiled`: its grammar, if at hand)."""
        keep = {"json_schema": self._keep_no_control, "json": self._keep_json_space}.get(guide.kind)
        return Matcher(self._xgr, compiled if compiled is not None else self.compile(guide), self.vocab_size, keep)

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


def _done(result: Any = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future
