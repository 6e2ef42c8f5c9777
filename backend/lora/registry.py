"""The configured adapters and the resident set: at most `max_loras` adapters' weights in memory,
the least recently used dropped when another one is needed (and read again from its folder)."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch

from splitfuse.lora.adapter import MLP_TARGETS, TARGETS, BaseShape, LoraAdapter, MakeKernel, load_adapter, plain_kernel
from splitfuse.lora.stacks import LoraStacks
from splitfuse.lora.stats import LoraStats

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, adapters: dict[str, str], base: BaseShape, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, make_kernel: MakeKernel = plain_kernel,
                 runtime: bool = False, layers: range | None = None) -> None:
        """Read and check every configured adapter now (a bad folder fails the start, not a
        request; the stacks are shaped for all of them); the first `max_loras` stay resident.
        `runtime`: adapters may be added and removed later (the stacks shaped for any of rank
        max_rank, on every projection). `layers`: a pipeline stage's range of the base's layers,
        the only ones whose weights are kept, keyed by their index in the stage."""
        self.paths = dict(adapters)
        self.layers = range(base.num_layers) if layers is None else layers
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self.dtype, self.device, self.make_kernel = dtype, device, make_kernel
        self.loads = self.evictions = 0
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slots: dict[str, int] = {}  # resident adapter -> its slot in the stacks
        self._resident_names: tuple[str, ...] = ()  # for stats() from other threads
        read = [self._load(name, path) for name, path in self.paths.items()]
        # Each adapter's content as first read: the prefix cache keys its KV by name, so a re-read
        # (after an eviction) must give the same weights.
        self._digests = {adapter.name: adapter.digest for adapter in read}
        stage = dataclasses.replace(base, num_layers=len(self.layers))
        self.stacks = LoraStacks(read, stage, max_loras, dtype, device, make_kernel,
                                 reserve_rank=max_rank if runtime else 0)
        self.runtime = runtime
        targets: set[str] = set(TARGETS) - (set(MLP_TARGETS) if base.moe else set()) if runtime else set()
        for adapter in read:
            targets |= adapter.targets
            if len(self._resident) < max_loras:
                self._make_resident(adapter)
            log.info("splitfuse: LoRA adapter %r from %s: rank %d on %s%s", adapter.name, adapter.path, adapter.rank,
                     ", ".join(sorted(adapter.targets)), "" if adapter.name in self._resident else " (not resident)")
        self.stacks.pack()
        self._resident_names = tuple(self._resident)
        self.targets = frozenset(targets)
        """HF projection names some configured adapter adapts."""

    def _load(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter (against the whole base), keeping this stage's layers."""
        return load_adapter(name, path, self.base, self.max_rank).keep_layers(self.layers)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def slot(self, name: str) -> int:
        """The stacks' slot of a resident adapter."""
        return self._slots[name]

    def _make_resident(self, adapter: LoraAdapter) -> None:
        adapter.to(self.device, self.dtype).pack(self.make_kernel)
        slot = min(set(range(self.max_loras)) - set(self._slots.values()))
        self.stacks.write(slot, adapter)
        self._resident[adapter.name] = adapter
        self._slots[adapter.name] = slot
        self.loads += 1

    def acquire(self, names: list[str]) -> list[LoraAdapter]:
        """The adapters `names` (distinct, at most max_loras: the scheduler keeps running sequences
        within that), made resident, evicting the least recently used others."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step uses {len(names)} LoRA adapters, more than max_loras={self.max_loras}")
        wanted = set(names)
        out = []
        for name in names:
            adapter = self._resident.get(name)
            if adapter is None:
                while len(self._resident) >= self.max_loras:
                    victim = next(n for n in self._resident if n not in wanted)
                    del self._resident[victim], self._slots[victim]
                    self.evictions += 1
                    log.info("splitfuse: LoRA adapter %r evicted (max_loras=%d)", victim, self.max_loras)
                adapter = self._load(name, self.paths[name])
                if adapter.digest != self._digests[name]:
                    raise ValueError(f"{adapter.path}: the adapter's files changed since the engine started (KV "
                                     "cached for its old weights would be reused); restart the engine to serve the "
                                     "new weights, or give them a new adapter name")
                self._make_resident(adapter)
                log.info("splitfuse: LoRA adapter %r loaded", name)
            self._resident.move_to_end(name)
            out.append(adapter)
        self.stacks.pack()
        self._resident_names = tuple(self._resident)
        return out

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter for `add` (any thread: only files are touched)."""
        if not self.runtime:
            raise ValueError("adapters cannot be loaded at run time here (no lora_load_dir)")
        return self._load(name, path)

    def add(self, adapter: LoraAdapter) -> None:
        """Serve an adapter `read` returned from now on (engine thread). ValueError, nothing
        changed, when its name is taken, max_loras adapters are known already, or the name
        served other weights before (the prefix cache may hold KV of those)."""
        name = adapter.name
        if name in self.paths:
            raise ValueError(f"lora_name: LoRA adapter {name!r} is already loaded; unload it first")
        if len(self.paths) >= self.max_loras:
            raise ValueError(f"lora_name: {len(self.paths)} LoRA adapters are loaded, max_loras={self.max_loras}; "
                             f"unload one of {', '.join(self.paths)} first")
        if self._digests.get(name, adapter.digest) != adapter.digest:
            raise ValueError(f"lora_name: {name!r} served other weights before (KV cached for them may be reused); "
                             "give these weights a new adapter name")
        self._digests[name] = adapter.digest
        self.paths[name] = adapter.path
        self._make_resident(adapter)  # room: fewer than max_loras are known
        self.stacks.pack()
        self._resident_names = tuple(self._resident)
        log.info("splitfuse: LoRA adapter %r loaded at run time from %s: rank %d on %s", name, adapter.path,
                 adapter.rank, ", ".join(sorted(adapter.targets)))

    def remove(self, name: str) -> None:
        """Stop serving `name` (engine thread; no sequence of it may be left). Its slot is free;
        its digest stays, so the name cannot come back with other weights."""
        del self.paths[name]
        if self._resident.pop(name, None) is not None:
            del self._slots[name]
        self._resident_names = tuple(self._resident)
        log.info("splitfuse: LoRA adapter %r unloaded", name)

    def stats(self) -> LoraStats:
        return LoraStats(configured=self.names, resident=list(self._resident_names), loads=self.loads,
                         evictions=self.evictions)
