"""One step as the engine's `schedule` decided it, from its launch to its collection.

With pipeline stages several steps are in flight at once (EngineConfig.pipeline_steps_in_flight):
a step's chunks count as computed from its launch, so the next step schedules what does not wait
on a token of it (other sequences, and the next chunks of prompts being split; every stage runs
the steps in launch order, so a chunk's KV is written before a later step reads it). A sequence
that ended or was preempted while its step was in flight gets nothing from that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.kv_offload import TierStep
from splitfuse.engine.micro_batches import MicroBatches
from splitfuse.engine.scheduler import ScheduledChunk, SchedulerOutput, sampling_chunks
from splitfuse.engine.sequence import RequestOutput, Sequence
from splitfuse.engine.stats import StepTally


@dataclass
class StepPlan:
    decision: SchedulerOutput
    batch: RaggedBatch | MicroBatches | None
    """The step's batch (cut into one micro-batch per pipeline stage with pipeline parallelism);
    None when it runs no forward pass."""
    failed: list[RequestOutput]
    """Final outputs of requests that left the step (their LoRA adapter failed to load)."""
    start: float
    """time.perf_counter() when scheduling began (the step's duration counts from there)."""
    tiers: TierStep | None = None
    """What moved between the KV pool and the tiers below it (kv_offload_*), before the forward."""
    tally: StepTally = field(default_factory=StepTally)
    sampling: list[ScheduledChunk] = field(default_factory=list)
    """The chunks that sample a token (`launched`), in the order of the sampling rows."""
    embedded: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)
    """The embedding requests whose prompt this step completes, with their vectors (pooling.py)."""
    _preemptions: list[int] = field(default_factory=list)

    def launched(self) -> None:
        """Record, at launch, which chunks sample and what their sequences are now."""
        self.sampling = sampling_chunks(self.decision.chunks)
        self._preemptions = [c.seq.num_preemptions for c in self.sampling]

    def current(self, index: int, live: dict[str, Sequence]) -> bool:
        """Is sampling chunk `index`'s sequence the one launched: still live (`live`, by request
        id) and not preempted since (its computed KV was dropped, to be recomputed)?"""
        seq = self.sampling[index].seq
        return live.get(seq.request_id) is seq and seq.num_preemptions == self._preemptions[index]
