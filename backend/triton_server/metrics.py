"""The `llm` model's Prometheus metrics, published through Triton's custom-metrics API.

Two halves: `MetricsRecorder` collects what happened (the engine thread records steps, tokens
and finished requests; plain Python, tested without Triton), and `TritonMetrics` publishes a
drained batch of it from the housekeeping thread (inside the Python-backend stub only: every
update is a round trip to the server process, so they are batched).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from splitfuse.engine.stats import EngineStats, StepStats
from splitfuse.engine.sequence import FinishReason, RequestOutput
from splitfuse.lora.stats import LoraStats

TOKENS_PER_STEP_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0]
REQUEST_TOKENS_BUCKETS = [2**i for i in range(17)]  # 1 .. 65536
FINISH_REASONS = [r.value for r in FinishReason]
REFUSAL_REASONS = ("queue_full", "queue_time")
"""Why a request was turned away busy: max_waiting_requests reached, or max_queue_time_s passed."""


@dataclass
class FinishedRequest:
    reason: str
    latency_s: float
    """Arrival to final output."""
    prompt_tokens: int | None
    generation_tokens: int | None
    """None when the engine held nothing of the request (it failed before or while being added)."""


@dataclass
class MetricsBatch:
    """Everything recorded since the previous drain."""

    steps: list[StepStats] = field(default_factory=list)
    first_token_latencies: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """A REFUSAL_REASONS entry per request turned away busy."""
    grammar_compiles: list[float] = field(default_factory=list)
    """Seconds each constrained request's guide took to compile (about 0 when cached)."""
    balance_waits: list[float] = field(default_factory=list)
    """Seconds of each wait this replica made before taking more requests (replica_balance.py)."""

    def total(self, field: str) -> float:
        """A StepStats count (or duration) summed over the steps."""
        return sum(getattr(s, field) for s in self.steps)

    @property
    def prompt_tokens(self) -> int:
        return self.total("num_prompt_tokens")

    @property
    def generation_tokens(self) -> int:
        return self.total("num_generated_tokens")

    @property
    def preemptions(self) -> int:
        return self.total("num_preemptions")


class MetricsRecorder:
    """Collects observations from any thread; `drain()` hands them over and starts afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch = MetricsBatch()

    def step(self, stats: StepStats) -> None:
        with self._lock:
            self._batch.steps.append(stats)

    def tokens(self, arrival: float, last_token: float | None, num_tokens: int, now: float) -> None:
        """`num_tokens` new tokens of a request at `now`; `last_token` is when its previous
        tokens came (None for its first)."""
        with self._lock:
            if last_token is None:
                self._batch.first_token_latencies.append(now - arrival)
            else:
                gap = (now - last_token) / num_tokens
                self._batch.inter_token_latencies.extend([gap] * num_tokens)

    def finished(self, out: RequestOutput, arrival: float, now: float) -> None:
        known = bool(out.prompt_token_ids)
        record = FinishedRequest(
            reason=out.finish_reason or "",
            latency_s=now - arrival,
            prompt_tokens=len(out.prompt_token_ids) if known else None,
            generation_tokens=len(out.token_ids) if known else None,
        )
        with self._lock:
            self._batch.finished.append(record)

    def constrained(self, compile_s: float) -> None:
        """A constrained request arrived; its guide compiled in `compile_s` seconds."""
        with self._lock:
            self._batch.grammar_compiles.append(compile_s)

    def balance_wait(self, seconds: float) -> None:
        """This replica held more requests than another and waited `seconds` before taking more."""
        with self._lock:
            self._batch.balance_waits.append(seconds)

    def refused(self, reason: str) -> None:
        with self._lock:
            self._batch.refused.append(reason)

    def drain(self) -> MetricsBatch:
        with self._lock:
            batch, self._batch = self._batch, MetricsBatch()
        return batch


STEP_COUNTERS = [
    # (Prometheus counter, the StepStats count it adds up, description)
    ("splitfuse_prompt_tokens_total", "num_prompt_tokens", "Prompt tokens computed"),
    ("splitfuse_generation_tokens_total", "num_generated_tokens", "Tokens generated"),
    ("splitfuse_preemptions_total", "num_preemptions",
     "Sequences preempted (KV freed, recomputed later) for lack of KV blocks"),
    ("splitfuse_prefix_cache_queries_total", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("splitfuse_prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens found in the prefix cache (KV reused)"),
    ("splitfuse_spec_draft_tokens_total", "spec_draft_tokens", "Proposed tokens verified (speculative decoding)"),
    ("splitfuse_spec_accepted_tokens_total", "spec_accepted_tokens",
     "Proposed tokens accepted (each a decode step saved)"),
    ("splitfuse_kv_events_total", "kv_events",
     "KV cache events (blocks stored in or removed from the prefix cache) queued for publishing (kv_events_endpoint)"),
    ("splitfuse_kv_event_batches_dropped_total", "kv_event_batches_dropped",
     "Batches of KV events dropped unsent because the publisher's queue was full (kv_events_max_queue)"),
    ("splitfuse_step_seconds_total", "duration_s",
     "Seconds spent in engine steps (its rate is the engine's busy share)"),
    ("splitfuse_forward_seconds_total", "forward_s", "Of the step seconds, the model's forward pass"),
    ("splitfuse_grammar_mask_seconds_total", "grammar_mask_s",
     "Of the step seconds, masking constrained requests' logits to their grammars (structured outputs)"),
    # The prefix cache's tiers below the KV pool (kv_offload_memory_gb, kv_offload_dir).
    ("splitfuse_kv_tier_memory_hits_total", "kv_tier_memory_hits",
     "Prefix-cache blocks restored from the host-RAM tier instead of computed"),
    ("splitfuse_kv_tier_disk_hits_total", "kv_tier_disk_hits",
     "Prefix-cache blocks restored from the disk tier instead of computed"),
    ("splitfuse_kv_tier_restored_tokens_total", "kv_tier_restored_tokens",
     "Prompt tokens whose KV was restored from a tier instead of computed"),
    ("splitfuse_kv_tier_restored_bytes_total", "kv_tier_restored_bytes", "Bytes of KV copied back from the tiers"),
    ("splitfuse_kv_tier_offloaded_bytes_total", "kv_tier_offloaded_bytes",
     "Bytes of KV the pool evicted copied down to the tiers"),
    ("splitfuse_kv_tier_corrupt_blocks_total", "kv_tier_corrupt_blocks",
     "Disk-tier blocks that failed their checks (deleted; their tokens computed)"),
    ("splitfuse_kv_tier_seconds_total", "kv_tier_s", "Of the step seconds, copying blocks to and from the tiers"),
    ("splitfuse_kv_tier_saved_seconds_total", "kv_tier_saved_s",
     "Estimated step seconds the tiers' restores saved (restored tokens at the measured prefill rate, "
     "less the copies)"),
]
KV_TIERS = ("memory", "disk")
GRAMMAR_COMPILE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


FAULT_GAUGES = [
    # (key in the launcher's faults.json, Prometheus gauge, description)
    ("restarts", "splitfuse_server_restarts",
     "Times the launcher restarted tritonserver after a process fault (a replica that died or hung)"),
    ("failed_requests", "splitfuse_requests_failed_by_faults",
     "Requests in flight in a server the launcher had to restart (each ended with an error)"),
    ("last_recovery_s", "splitfuse_last_recovery_seconds",
     "Seconds from the last fault's detection to the restarted server being ready"),
]
ENGINE_FAULT_GAUGES = [
    # (RemoteEngine attribute, Prometheus gauge per instance, description)
    ("restarts", "splitfuse_engine_restarts",
     "Times this replica restarted its engine process after it died or hung (engine_process)"),
    ("fault_failed_requests", "splitfuse_engine_fault_failed_requests",
     "Requests of this replica ended with an error because its engine process died or hung"),
    ("last_recovery_s", "splitfuse_engine_last_recovery_seconds",
     "Seconds from this replica's last engine fault to its new engine process serving"),
]


class TritonMetrics:
    """Prometheus families through `pb_utils.MetricFamily`, labelled by model, version and
    instance. The families are kept on self: a Metric whose family was garbage-collected fails
    on every update."""

    def __init__(self, labels: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # exists inside the Python-backend stub only

        MF = pb_utils.MetricFamily

        def family(name: str, description: str, kind) -> object:
            self._families.append(MF(name=name, description=description, kind=kind))
            return self._families[-1]

        self._families: list = []
        kv = family("splitfuse_kv_cache_blocks", "KV-cache blocks by state", MF.GAUGE)
        req = family("splitfuse_requests", "Requests in the engine by state", MF.GAUGE)
        finished = family("splitfuse_requests_finished_total", "Requests finished, by finish reason", MF.COUNTER)
        self.kv_used = kv.Metric(labels={**labels, "state": "used"})
        self.kv_free = kv.Metric(labels={**labels, "state": "free"})
        tier_bytes = family("splitfuse_kv_tier_bytes", "Bytes the prefix cache's tiers below the KV pool hold "
                            "(disk: as this replica counts them)", MF.GAUGE)
        self.kv_tier_bytes = {tier: tier_bytes.Metric(labels={**labels, "tier": tier}) for tier in KV_TIERS}
        self.kv_usage = family("splitfuse_kv_cache_usage_ratio", "Share of KV-cache blocks in use (0-1)",
                               MF.GAUGE).Metric(labels=labels)
        self.running = req.Metric(labels={**labels, "state": "running"})
        self.waiting = req.Metric(labels={**labels, "state": "waiting"})
        self.healthy = family("splitfuse_engine_healthy",
                              "1 while the engine serves, 0 once it failed for good (requests then get "
                              "UNAVAILABLE errors)", MF.GAUGE).Metric(labels=labels)
        self.tokens_per_step = family("splitfuse_tokens_per_step", "Tokens in each engine step (forward pass)",
                                      MF.HISTOGRAM).Metric(labels=labels, buckets=TOKENS_PER_STEP_BUCKETS)
        self.step_counters = {
            stat: family(name, description, MF.COUNTER).Metric(labels=labels)
            for name, stat, description in STEP_COUNTERS
        }
        self.ttft = family("splitfuse_time_to_first_token_seconds",
                           "Time from request arrival to its first generated token",
                           MF.HISTOGRAM).Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.itl = family("splitfuse_inter_token_latency_seconds",
                          "Time between consecutive generated tokens of a request",
                          MF.HISTOGRAM).Metric(labels=labels, buckets=ITL_BUCKETS)
        self.e2e = family("splitfuse_e2e_request_latency_seconds",
                          "Time from request arrival to its final output",
                          MF.HISTOGRAM).Metric(labels=labels, buckets=E2E_BUCKETS)
        self.request_prompt_tokens = family("splitfuse_request_prompt_tokens", "Prompt length of finished requests",
                                            MF.HISTOGRAM).Metric(labels=labels, buckets=REQUEST_TOKENS_BUCKETS)
        self.request_generation_tokens = family(
            "splitfuse_request_generation_tokens", "Tokens generated by finished requests",
            MF.HISTOGRAM).Metric(labels=labels, buckets=REQUEST_TOKENS_BUCKETS)
        self.finished = {reason: finished.Metric(labels={**labels, "reason": reason}) for reason in FINISH_REASONS}
        self.constrained = family("splitfuse_constrained_requests_total",
                                  "Requests with a structured-output guide (json, json_schema, regex, ebnf_grammar, "
                                  "choice)", MF.COUNTER).Metric(labels=labels)
        self.grammar_compile = family("splitfuse_grammar_compile_seconds",
                                      "Time to compile a constrained request's guide (cached by its text)",
                                      MF.HISTOGRAM).Metric(labels=labels, buckets=GRAMMAR_COMPILE_BUCKETS)
        refused = family("splitfuse_requests_refused_total",
                         "Requests turned away because the replica was busy, by reason (queue_full: "
                         "max_waiting_requests reached; queue_time: not started within max_queue_time_s)",
                         MF.COUNTER)
        self.refused = {reason: refused.Metric(labels={**labels, "reason": reason}) for reason in REFUSAL_REASONS}
        self.balance_waits = family("splitfuse_replica_balance_waits_total",
                                    "Times this replica held more requests than another and waited before taking "
                                    "more, so Triton gave new ones to the others (replica_balance_max_wait_ms)",
                                    MF.COUNTER).Metric(labels=labels)
        self.balance_wait_s = family("splitfuse_replica_balance_wait_seconds_total",
                                     "Seconds this replica spent in those waits", MF.COUNTER).Metric(labels=labels)
        self._add_lora_and_fault_metrics(family, MF, labels)

    def _add_lora_and_fault_metrics(self, family, MF, labels: dict[str, str]) -> None:
        """Per-adapter counters (labelled as adapters appear) and the launcher's restart record."""
        self._lora_families = {
            "requests": family("splitfuse_lora_requests_total", "Requests accepted per LoRA adapter (lora_name)",
                               MF.COUNTER),
            "loads": family("splitfuse_lora_adapter_loads_total",
                            "Times a LoRA adapter's weights were read into memory (at start, and again after an "
                            "eviction)", MF.COUNTER),
            "evictions": family("splitfuse_lora_adapter_evictions_total",
                                "LoRA adapters dropped from memory to make room for another (max_loras)",
                                MF.COUNTER),
        }
        self.lora_resident = family("splitfuse_lora_adapters_resident",
                                    "LoRA adapters whose weights are in memory (at most max_loras)",
                                    MF.GAUGE).Metric(labels=labels)
        self._lora_labels = labels
        self._lora_counters: dict[tuple[str, str], object] = {}
        self._lora_published: dict[tuple[str, str], int] = {}
        self._gauges: dict[str, float] = {}
        # The launcher's record of server restarts, the same for every instance: gauges without
        # the instance label, which every instance sets alike (a counter would add up per instance).
        server = {k: v for k, v in labels.items() if k != "instance"}
        self.fault_gauges = {
            key: family(name, description, MF.GAUGE).Metric(labels=server)
            for key, name, description in FAULT_GAUGES
        }
        self.engine_fault_gauges = {
            key: family(name, description, MF.GAUGE).Metric(labels=labels)
            for key, name, description in ENGINE_FAULT_GAUGES
        }

    def publish(self, batch: MetricsBatch, stats: EngineStats | None, healthy: bool) -> None:
        for s in batch.steps:
            self.tokens_per_step.observe(s.num_tokens)
        for stat, counter in self.step_counters.items():
            value = batch.total(stat)
            if value:
                counter.increment(value)
        for v in batch.first_token_latencies:
            self.ttft.observe(v)
        for v in batch.inter_token_latencies:
            self.itl.observe(v)
        for r in batch.finished:
            self.e2e.observe(r.latency_s)
            if r.reason in self.finished:
                self.finished[r.reason].increment(1)
            if r.prompt_tokens is not None:
                self.request_prompt_tokens.observe(r.prompt_tokens)
                self.request_generation_tokens.observe(r.generation_tokens)
        for reason in batch.refused:
            self.refused[reason].increment(1)
        if batch.balance_waits:
            self.balance_waits.increment(len(batch.balance_waits))
            self.balance_wait_s.increment(sum(batch.balance_waits))
        if batch.grammar_compiles:
            self.constrained.increment(len(batch.grammar_compiles))
            for v in batch.grammar_compiles:
                self.grammar_compile.observe(v)
        self._set("healthy", 1.0 if healthy else 0.0)
        if stats is not None:
            # From the engine's own counters: right even when no step follows an abort.
            self._set("kv_used", stats.kv_blocks_used)
            self._set("kv_free", stats.kv_blocks_free)
            self._set("kv_usage", stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
            self._set("running", stats.num_running)
            self._set("waiting", stats.num_waiting)
            for tier, used in zip(KV_TIERS, (stats.kv_tier_memory_bytes, stats.kv_tier_disk_bytes)):
                if self._gauges.get("kv_tier:" + tier) != used:
                    self._gauges["kv_tier:" + tier] = used
                    self.kv_tier_bytes[tier].set(used)

    def publish_lora(self, stats: LoraStats) -> None:
        """The engine's LoRA counters (cumulative: each counter grows by what is new since the
        last call) and its resident set."""
        totals = {("requests", name): count for name, count in stats.requests.items()}
        totals[("loads", "")], totals[("evictions", "")] = stats.loads, stats.evictions
        for key, total in totals.items():
            counter = self._lora_counter(*key)  # every adapter's series from the start, at 0
            new = total - self._lora_published.get(key, 0)
            if new > 0:
                counter.increment(new)
                self._lora_published[key] = total
        self._set("lora_resident", float(len(stats.resident)))

    def _lora_counter(self, kind: str, adapter: str):
        counter = self._lora_counters.get((kind, adapter))
        if counter is None:
            labels = {**self._lora_labels, "adapter": adapter} if adapter else self._lora_labels
            counter = self._lora_counters[(kind, adapter)] = self._lora_families[kind].Metric(labels=labels)
        return counter

    def record_faults(self, faults: dict) -> None:
        """The launcher's fault record (control.read_faults) for this server's life."""
        for key, gauge in self.fault_gauges.items():
            value = float(faults.get(key, 0))
            if self._gauges.get("fault:" + key) != value:  # each update is a round trip
                self._gauges["fault:" + key] = value
                gauge.set(value)

    def publish_engine_faults(self, engine: object) -> None:
        """This replica's own engine-process faults (a RemoteEngine's counts, since the stub began)."""
        for key, gauge in self.engine_fault_gauges.items():
            value = float(getattr(engine, key))
            if self._gauges.get("engine:" + key) != value:
                self._gauges["engine:" + key] = value
                gauge.set(value)

    def _set(self, name: str, value: float) -> None:
        # Each update is a round trip to the server process: skip unchanged values.
        if self._gauges.get(name) != value:
            self._gauges[name] = value
            getattr(self, name).set(value)

    def close(self) -> None:
        # Metrics before their families (see the class docstring).
        for name in list(vars(self)):
            if name not in ("_families", "_gauges"):
                setattr(self, name, None)
        self._families.clear()
