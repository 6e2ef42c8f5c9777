"""LoRA adapters loaded and unloaded while the engine serves (EngineConfig.lora_load_dir).

Reading an adapter touches only files and runs on the caller's thread; adding and removing it
change the stacks the forward pass reads and run on the engine thread. An unloaded adapter's
running requests finish with it: it is refused to new requests at once and leaves the registry
(its slot free) when its last sequence ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from splitfuse.config import LORA_NAME
from splitfuse.errors import UnknownLoraError
from splitfuse.engine.sequence import Sequence
from splitfuse.engine.validation import RequestValidator
from splitfuse.lora.adapter import LoraAdapter
from splitfuse.lora.registry import LoraRegistry


def path_in_dir(load_dir: str, path: str) -> str:
    """`path` (relative ones under `load_dir`) resolved, links included; ValueError naming
    lora_path when it leads outside `load_dir` (a client must not make the server read any file)."""
    if not isinstance(path, str) or not path:
        raise ValueError("lora_path: must be a non-empty folder path")
    root = Path(load_dir).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"lora_path: {path!r} is outside the folder adapters may be loaded from (lora_load_dir)")
    if not resolved.is_dir():
        raise ValueError(f"lora_path: {path!r} is not a folder under lora_load_dir")
    return os.fspath(resolved)


class LoraControl:
    def __init__(self, registry: LoraRegistry | None, load_dir: str, validator: RequestValidator,
                 counts: dict[str, int]) -> None:
        self.registry = registry
        self.load_dir = load_dir
        self.validator = validator
        self.counts = counts  # requests per adapter (LLMEngine's, for metrics)
        self.unloading: set[str] = set()
        self._publish()

    def names(self) -> list[str]:
        """The adapters requests may name now."""
        return [n for n in self.registry.names if n not in self.unloading] if self.registry is not None else []

    def read(self, name: str, path: str) -> LoraAdapter:
        """Check and read the adapter a load names (any thread); ValueError naming the field."""
        if self.registry is None or not self.registry.runtime:
            raise ValueError("LoRA adapters cannot be loaded at run time: the engine has no lora_load_dir")
        if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
            raise ValueError(f"lora_name: {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -")
        return self.registry.read(name, path_in_dir(self.load_dir, path))

    def load(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` from now on (engine thread); ValueError, nothing changed, if it cannot be."""
        if adapter.name in self.unloading:
            raise ValueError(f"lora_name: {adapter.name!r} is still unloading (requests of it are running); "
                             "retry when they finish")
        self.registry.add(adapter)
        self.counts.setdefault(adapter.name, 0)
        self._publish()

    def unload(self, name: str, seqs: Iterable[Sequence]) -> None:
        """Refuse `name` to new requests now; drop it once `seqs` (the engine's) hold none of it."""
        if name not in self.names():
            served = ", ".join(self.names()) or "none"
            raise UnknownLoraError(f"lora_name: unknown LoRA adapter {name!r}; loaded: {served}")
        self.unloading.add(name)
        self._publish()
        self.released(None, name, seqs)

    def released(self, seq: Sequence | None, name: str | None, seqs: Iterable[Sequence]) -> None:
        """`seq` of adapter `name` ended (engine thread): drop the adapter if it was its last one
        and it is unloading."""
        if name in self.unloading and not any(s.params.lora_name == name and s is not seq for s in seqs):
            self.unloading.discard(name)
            self.registry.remove(name)

    def _publish(self) -> None:
        self.validator.lora_names = frozenset(self.names())
