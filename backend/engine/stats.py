"""What the engine reports: each step's counts and timings (StepStats, for metrics and
benchmarks) and the KV pool and queues at a moment (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """What one engine step did, for metrics and benchmarks."""

    num_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    duration_s: float
    forward_s: float
    num_preemptions: int = 0
    """Sequences preempted (KV freed, to be recomputed) while scheduling this step."""
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted this step looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found in the cache (not computed)."""
    spec_draft_tokens: int = 0
    """Proposed tokens verified this step (speculative decoding)."""
    spec_accepted_tokens: int = 0
    """Of those, tokens accepted (each one a decode step saved)."""
    grammar_mask_s: float = 0.0
    """Seconds spent masking constrained sequences' logits to their grammars."""
    kv_events: int = 0
    """KV cache events (blocks stored, removed) this step queued for publishing (kv_events_endpoint)."""
    kv_event_batches_dropped: int = 0
    """Older batches of KV events dropped unsent to queue this step's (kv_events_max_queue)."""
    kv_tier_memory_hits: int = 0
    """Blocks restored from the host-RAM tier below the KV pool (kv_offload_memory_gb)."""
    kv_tier_disk_hits: int = 0
    """Blocks restored from the disk tier (kv_offload_dir)."""
    kv_tier_restored_tokens: int = 0
    """Prompt tokens whose KV came from a tier instead of being computed."""
    kv_tier_restored_bytes: int = 0
    kv_tier_offloaded_bytes: int = 0
    """Bytes of blocks the pool evicted copied down to a tier."""
    kv_tier_corrupt_blocks: int = 0
    """Disk blocks that failed their checks: deleted, their tokens computed."""
    kv_tier_s: float = 0.0
    """Seconds of the step spent copying blocks to and from the tiers."""
    kv_tier_saved_s: float = 0.0
    """Estimated seconds the restores saved: restored tokens at the engine's measured prefill
    seconds per token, less kv_tier_s (0 when that is negative)."""


@dataclass
class EngineStats:
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    kv_tier_memory_bytes: int = 0
    """Bytes the host-RAM tier holds."""
    kv_tier_disk_bytes: int = 0
    """Bytes the disk tier holds, as this process estimates them (others may share the folder)."""


@dataclass
class StepTally:
    """What one step counts and times as it runs, for its StepStats."""

    prompt_tokens: int = 0
    generated: int = 0
    drafts: int = 0
    accepted: int = 0
    forward_s: float = 0.0
    grammar_mask_s: float = 0.0
    kv_events: int = 0
    kv_event_batches_dropped: int = 0
