"""What a constrained request asks for. TensorRT-LLM's Triton backend names the kinds
(`guided_decoding_guide_type`: json, json_schema, regex, ebnf_grammar); `choice` is a JSON list
of the strings the output must be one of."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

GUIDE_KINDS = ("json", "json_schema", "regex", "ebnf_grammar", "choice")
# A guide is compiled on the caller's thread; its size bounds that work and the cache's memory.
MAX_GUIDE_LENGTH = 64 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Guide:
    kind: str
    """One of GUIDE_KINDS."""
    text: str = ""
    """The schema, expression, grammar or JSON list of choices; empty for `json` (any JSON)."""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GUIDE_LENGTH:
            raise ValueError(f"guided_decoding_guide must be a string of at most {MAX_GUIDE_LENGTH} characters")
        if self.kind != "json" and not self.text:
            raise ValueError(f"guided_decoding_guide is required for guided_decoding_guide_type {self.kind!r}")
        if self.kind == "choice":
            self.choices()  # raises on a malformed list

    def choices(self) -> list[str]:
        try:
            options = json.loads(self.text)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided_decoding_guide for choice must be a JSON list of strings: {e}") from None
        if not (isinstance(options, list) and options and len(options) <= MAX_CHOICES
                and all(isinstance(o, str) and o for o in options)):
            raise ValueError(f"guided_decoding_guide for choice must be a JSON list of 1 to {MAX_CHOICES} "
                             "non-empty strings")
        return options

    def normalized(self) -> Guide:
        """The guide with edits that leave its grammar alone undone, to key remembered failures
        by: a JSON schema or choice list parsed and re-dumped with sorted keys and no whitespace;
        a regex or grammar with each run of whitespace made one space. It does not catch edits
        that change the grammar (another pattern, an added property or enum value)."""
        if self.kind in ("json_schema", "choice"):
            try:
                text = json.dumps(json.loads(self.text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            except (ValueError, RecursionError):
                return self
        elif self.kind in ("regex", "ebnf_grammar"):
            text = re.sub(r"\s+", " ", self.text).strip()
        else:
            return self
        try:
            return Guide(self.kind, text)
        except ValueError:  # e.g. a regex of whitespace only: kept as it was
            return self
