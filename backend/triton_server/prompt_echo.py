"""The prompt's text for a response that leads with it (exclude_input_in_output=false)."""

from __future__ import annotations

import threading
from typing import Any

from splitfuse.triton_server.request import Parsed


class PromptEcho:
    """A text prompt is echoed as sent; one sent as ids is decoded with the engine's tokenizer.
    With the engine in its own process the stub has no tokenizer: it is loaded here on first use
    (transformers imports torch, ~2 s and ~150 MB, which a replica whose prompts come as text, or
    are not echoed, never pays)."""

    def __init__(self, tokenizer: Any = None, tokenizer_dir: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._tokenizer_dir = tokenizer_dir
        self._lock = threading.Lock()

    def text(self, parsed: Parsed, prompt_token_ids: list[int]) -> str:
        if parsed.prompt_text is not None:
            return parsed.prompt_text
        return self._tokenizer_loaded().decode(prompt_token_ids, skip_special_tokens=True)

    def _tokenizer_loaded(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
            return self._tokenizer
