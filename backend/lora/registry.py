"""The configured adapters and the resident set: at most `max_loras` adapters' weights in memory,
the least recently used dropped when another one is needed (and read again from its folder)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from splitfuse.lora.adapter import BaseShape, LoraAdapter, MakeKernel, load_adapter, plain_kernel
from splitfuse.lora.stacks import LoraStacks

log = logging.getLogger(__name__)


@dataclass
class LoraStats:
    """What the adapters are doing, for metrics."""

    configured: list[str]
    resident: list[str]
    """Adapters whose weights are in memory, least recently used first."""
    loads: int
    """Times an adapter's weights were read into memory (at start and after evictions)."""
    evictions: int
    requests: dict[str, int] = field(default_factory=dict)
    """Requests accepted per adapter."""


class LoraRegistry:
    def __init__(self, adapters: dict[str, str], base: BaseShape, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, make_kernel: MakeKernel = plain_kernel) -> None:
        """Read and check every configured adapter now (a bad folder fails the start, not a
        request; the stacks are shaped for all of them); the first `max_loras` stay resident."""
        self.paths = dict(adapters)
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self.dtype, self.device, self.make_kernel = dtype, device, make_kernel
        self.loads = self.evictions = 0
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slots: dict[str, int] = {}  # resident adapter -> its slot in the stacks
        self._resident_names: tuple[str, ...] = ()  # for stats() from other threads
        read = [load_adapter(name, path, base, max_rank) for name, path in self.paths.items()]
        # Each adapter's content as first read: the prefix cache keys its KV by name, so a re-read
        # (after an eviction) must give the same weights.
        self._digests = {adapter.name: adapter.digest for adapter in read}
        self.stacks = LoraStacks(read, base, max_loras, dtype, device, make_kernel)
        targets: set[str] = set()
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
                adapter = load_adapter(name, self.paths[name], self.base, self.max_rank)
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

    def stats(self) -> LoraStats:
        return LoraStats(configured=self.names, resident=list(self._resident_names), loads=self.loads,
                         evictions=self.evictions)
