"""The engine's side of the tiers below the KV pool (kv_tiers/, docs/kv_tiers.md): between
scheduling and the forward pass, the blocks the pool evicted are copied down and the blocks
admissions found in a tier are copied back in.

Order within a step: (1) read what the restores need from the tiers, before an offload can push
it out of the memory tier; (2) copy the evicted blocks' KV out of the pool, before a restore or
the forward pass writes into those blocks (a block evicted this step may be a restore's or a
new chunk's block now); (3) copy the restored KV into its blocks. The block manager names the
evicted blocks, the scheduler the restores, the runner copies (it owns the tensors); this module
only orders them and counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitfuse.config import EngineConfig
from splitfuse.engine.block_manager import BlockManager
from splitfuse.engine.model_runner import ModelRunner
from splitfuse.engine.scheduler import Scheduler, TierRestore
from splitfuse.engine.stats import StepStats
from splitfuse.kv_tiers.disk_tier import DiskTier
from splitfuse.kv_tiers.memory_tier import MemoryTier
from splitfuse.kv_tiers.tiered_store import MEDIUM_DISK, MEDIUM_MEMORY, TieredStore, TierListener

GIB = 1 << 30


@dataclass
class TierStep:
    """What one step moved between the pool and the tiers."""

    memory_hits: int = 0
    """Blocks restored from the host-RAM tier."""
    disk_hits: int = 0
    """Blocks restored from the disk tier."""
    restored_tokens: int = 0
    """Prompt tokens whose KV was restored instead of computed."""
    restored_bytes: int = 0
    offloaded_bytes: int = 0
    """Bytes of evicted blocks copied down (blocks a tier held already are not copied again)."""
    corrupt_blocks: int = 0
    """Disk blocks that failed their checks (deleted; their requests computed them)."""
    seconds: float = 0.0
    """Time the copies and the tiers' reads and writes took."""


class KVOffload:
    def __init__(self, config: EngineConfig, runner: ModelRunner, listener: TierListener | None = None) -> None:
        self.runner = runner
        self.fingerprint = runner.kv_fingerprint().digest()
        memory = MemoryTier(int(config.kv_offload_memory_gb * GIB)) if config.kv_offload_memory_gb > 0 else None
        disk = (DiskTier(config.kv_offload_dir, int(config.kv_offload_disk_gb * GIB), self.fingerprint)
                if config.kv_offload_dir else None)
        self.store = TieredStore(self.fingerprint, memory, disk, listener)
        self._prefill_s_per_token: float | None = None  # measured, for kv_tier_saved_s

    def prefix_length(self, hashes: list[bytes]) -> int:
        """The scheduler's `tier_prefix`: how many of a chain's hashes, from the first, a tier holds."""
        return self.store.prefix_length(hashes)

    def move(self, blocks: BlockManager, scheduler: Scheduler, restores: list[TierRestore]) -> TierStep:
        """This step's copies, in the order the module's docstring gives; tells the scheduler how
        many blocks of each restore arrived."""
        start = time.perf_counter()
        step = TierStep()
        fetched = [self._fetch(r, step) for r in restores]
        self._offload(blocks.drain_evicted(), step)
        ids, payloads = [], []
        for restore, got in zip(restores, fetched):
            ids += restore.seq.block_table[restore.first_block : restore.first_block + len(got)]
            payloads += got
        if ids:
            self.runner.write_kv_blocks(ids, payloads)
        for restore, got in zip(restores, fetched):
            scheduler.restored(restore, len(got))
            step.restored_tokens += len(got) * blocks.block_size
        step.seconds = time.perf_counter() - start
        return step

    def _fetch(self, restore: TierRestore, step: TierStep) -> list[memoryview]:
        """The payloads of `restore`'s blocks up to the first that cannot be restored."""
        payloads = []
        for key in restore.hashes:
            found = self.store.fetch(key)
            if found.payload is None:
                step.corrupt_blocks += found.corrupt
                break
            step.memory_hits += found.medium == MEDIUM_MEMORY
            step.disk_hits += found.medium == MEDIUM_DISK
            step.restored_bytes += len(found.payload)
            payloads.append(found.payload)
        return payloads

    def _offload(self, evicted: list[tuple[bytes, int]], step: TierStep) -> None:
        fresh = [(key, block) for key, block in evicted if not self.store.refresh(key)]
        if not fresh:
            return
        blobs = self.runner.read_kv_blocks([block for _, block in fresh], self.fingerprint)
        for (key, _), blob in zip(fresh, blobs):
            self.store.put(key, blob)
            step.offloaded_bytes += len(blob)

    def record(self, tiers: TierStep, stats: StepStats) -> None:
        """The step's tier counts into its stats, and the time its restores saved at the measured
        prefill rate (from steps that are mostly prompt tokens)."""
        if stats.num_prompt_tokens * 2 >= stats.num_tokens > 0:
            rate = stats.forward_s / stats.num_tokens
            prev = self._prefill_s_per_token
            self._prefill_s_per_token = rate if prev is None else 0.9 * prev + 0.1 * rate
        saved = tiers.restored_tokens * (self._prefill_s_per_token or 0.0) - tiers.seconds
        stats.kv_tier_memory_hits, stats.kv_tier_disk_hits = tiers.memory_hits, tiers.disk_hits
        stats.kv_tier_restored_tokens, stats.kv_tier_restored_bytes = tiers.restored_tokens, tiers.restored_bytes
        stats.kv_tier_offloaded_bytes, stats.kv_tier_corrupt_blocks = tiers.offloaded_bytes, tiers.corrupt_blocks
        stats.kv_tier_s, stats.kv_tier_saved_s = tiers.seconds, max(0.0, saved)

    def used_bytes(self) -> tuple[int, int]:
        """(host-RAM tier bytes, disk tier bytes as this process estimates them)."""
        return self.store.used_bytes()
