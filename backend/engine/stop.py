"""Where a sequence's generation ends, checked after each token it appends: an EOS or stop token,
its grammar complete, max_tokens, or the model's context. (Stop strings are matched on the text,
by the detokenizer.)"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from splitfuse.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from splitfuse.structured.matcher import Matcher


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token: int, matcher: Matcher | None) -> FinishReason | None:
        """Why `seq` ends with `token`, just appended (and accepted by its matcher); None if it
        goes on."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if matcher is not None and matcher.terminated:  # the grammar is complete (ignore_eos or not)
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def eos_token_ids(model_dir: str, config_eos: Iterable[int], tokenizer_eos: int | None) -> set[int]:
    """The tokens that end a sequence: generation_config.json's (what HF generate() stops on),
    else the model config's; and the tokenizer's EOS."""
    ids = set(generation_eos_ids(model_dir) or config_eos)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return ids


def generation_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json, which HF generate() stops on."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
