"""Compiling guides into token-level grammars (xgrammar) and following them while decoding.

A guide is compiled once per text for the engine's tokenizer (on the caller's thread, by
`LLMEngine.prepare_prompt`, so the engine thread finds it compiled) and each constrained
sequence gets a matcher: before sampling, its row of logits is masked to the tokens the grammar
allows next; after sampling, the matcher accepts the token. Speculation skips constrained
sequences (their proposals are never made), so a matcher only ever moves forward; a preempted
sequence keeps its matcher, as its tokens do not change when they are recomputed.
Matchers live in matcher.py.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from splitfuse.structured.guide import Guide
from splitfuse.structured.matcher import Matcher


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
        self._compiler = xgrammar.GrammarCompiler(info)
        # xgrammar's JSON grammars let a string hold raw control characters (bytes below 0x20),
        # which JSON forbids (json.loads refuses them): tokens holding one are masked out of
        # JSON outputs; between values only the whitespace JSON allows may appear.
        vocab = info.decoded_vocab
        control = [any(b < 0x20 for b in token) for token in vocab]
        not_json_space = [any(b < 0x20 and b not in (0x09, 0x0A, 0x0D) for b in token) for token in vocab]
        specials = set(info.special_token_ids) | set(info.stop_token_ids)
        self._no_control = torch.tensor([c and i not in specials for i, c in enumerate(control)])
        self._no_bad_space = torch.tensor([c and i not in specials for i, c in enumerate(not_json_space)])
        self._compiled: dict[Guide, Any] = {}
        self._lock = threading.Lock()

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of `guide`; ValueError naming the problem when it does not compile."""
        with self._lock:
            found = self._compiled.get(guide)
        if found is not None:
            return found
        c = self._compiler
        try:
            if guide.kind == "json":
                compiled = c.compile_builtin_json_grammar()
            elif guide.kind == "json_schema":
                try:
                    json.loads(guide.text)  # a clear message for JSON that is not even JSON
                except json.JSONDecodeError as e:
                    raise ValueError(f"guided_decoding_guide (json_schema) is not valid JSON: {e}") from None
                compiled = c.compile_json_schema(guide.text, any_whitespace=False)
            elif guide.kind == "regex":
                compiled = c.compile_regex(guide.text)
            elif guide.kind == "ebnf_grammar":
                compiled = c.compile_grammar(guide.text)
            else:
                alternatives = " | ".join(json.dumps(option) for option in guide.choices())
                compiled = c.compile_grammar(f"root ::= {alternatives}")
        except ValueError:
            raise
        except Exception as e:  # xgrammar reports a bad schema, expression or grammar its own ways
            raise ValueError(f"guided_decoding_guide ({guide.kind}) does not compile: "
                             f"{type(e).__name__}: {str(e)[:500]}") from None
        with self._lock:
            self._compiled[guide] = compiled
        return compiled

    def matcher(self, guide: Guide) -> Matcher:
        forbidden = {"json_schema": self._no_control, "json": self._no_bad_space}.get(guide.kind)
        return Matcher(self._xgr, self.compile(guide), self.vocab_size, forbidden)
