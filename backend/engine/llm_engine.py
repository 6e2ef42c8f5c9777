"""The step loop: requests in, one scheduled forward pass per step, outputs out.

    step = execute(schedule()):  schedule -> forward -> sample -> update

`schedule` decides the step and builds its batch; `execute` runs the forward pass, samples
(grammar masks: structured/masking.py; draft verification: spec_decode/), then appends the
tokens, checks where each sequence stops (stop.py) and builds the outputs (outputs.py).
Single-threaded by design; `EngineLoop` (loop.py) drives it from a background thread for
servers, handing out a step's outputs between the next step's `schedule` and `execute`; `LLM`
(llm.py) drives it inline for offline use.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch
from transformers import AutoTokenizer

from splitfuse.config import EngineConfig
from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.micro_batches import MicroBatches
from splitfuse.engine.block_manager import BlockManager
from splitfuse.engine.detokenizer import IncrementalDetokenizer
from splitfuse.engine.kv_offload import KVOffload
from splitfuse.engine.lora_control import LoraControl
from splitfuse.engine.model_runner import ModelRunner
from splitfuse.engine.outputs import error_output, request_output
from splitfuse.engine.pooling import Pooler
from splitfuse.engine.sampler import SampledToken, Sampler, sample_isolated
from splitfuse.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, sampling_chunks
from splitfuse.engine.sequence import FinishReason, RequestOutput, SamplingParams, Sequence
from splitfuse.engine.stage_sampling import StageSampling
from splitfuse.engine.stats import EngineStats, StepStats, StepTally
from splitfuse.engine.step_plan import StepPlan
from splitfuse.engine.stop import StopChecker, eos_token_ids
from splitfuse.engine.validation import RequestValidator
from splitfuse.errors import SERVER_BUSY
from splitfuse.kv_events.events import KvEventLog
from splitfuse.kv_events.publisher import KvEventPublisher
from splitfuse.lora.stats import LoraStats
from splitfuse.models.gguf_checkpoint import with_checkpoint_dirs
from splitfuse.spec_decode.decoder import make_speculative_decoder, sampling_rows, verified_tokens
from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.masking import GrammarMasking

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = with_checkpoint_dirs(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.args.vocab_size
        # KV events (kv_events_endpoint): the pool's and the tiers' stores and removals, in one log;
        # the first batch starts with AllBlocksCleared, so a router drops what it knew of an engine
        # that was at this endpoint before (its subscriber has reconnected by then).
        self.kv_event_log = KvEventLog() if config.kv_events_endpoint else None
        if self.kv_event_log is not None:
            self.kv_event_log.cleared()
        self.offload = (KVOffload(config, self.runner, listener=self._tier_event if self.kv_event_log else None)
                        if config.kv_offload_tiers else None)
        self.blocks = BlockManager(self.runner.num_kv_blocks, config.block_size, config.kv_watermark,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   record_evictions=self.offload is not None, kv_events=self.kv_event_log)
        self.scheduler = Scheduler(self.blocks, config.token_budget, config.max_num_seqs, config.scheduler_policy,
                                   config.speculative_disable_batch_size, max_loras=config.max_loras,
                                   prompt_order=config.prompt_order,
                                   first_token_deadline_tokens_per_s=config.first_token_deadline_tokens_per_s,
                                   tier_prefix=self.offload.prefix_length if self.offload is not None else None)
        self._lora_requests: dict[str, int] = {name: 0 for name in (self.runner.lora.names if self.runner.lora else [])}
        self.masking = GrammarMasking(self.tokenizer, self.vocab_size, config.grammar_limits())
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len,
                                          self._lora_requests, embeddings=config.pipeline_parallel_size == 1)
        self.loras = LoraControl(self.runner.lora, config.lora_load_dir, self.validator, self._lora_requests)
        self.speculation = make_speculative_decoder(config, self.max_model_len, self.vocab_size)
        eos = eos_token_ids(config.model, self.runner.args.eos_token_ids, self.tokenizer.eos_token_id)
        self.stop = StopChecker(eos, self.max_model_len)
        self.sampler = Sampler(eos, config.seed)
        self._seqs: dict[str, Sequence] = {}
        self.pooler = Pooler()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self.last_step: StepStats | None = None
        self.kv_event_publisher = self._start_kv_events(config)
        self.steps_in_flight = ((config.pipeline_steps_in_flight or config.pipeline_parallel_size)
                                if config.pipeline_parallel_size > 1 else 1)
        self._in_flight: deque[StepPlan] = deque()

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a request (its one check) and return its prompt token ids; ValueError naming
        the field. Thread-safe: servers call it on their own threads before enqueuing."""
        return self.validator.prepare(prompt, params)

    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name (SamplingParams.lora_name): configured and loaded."""
        return self.loras.names()

    def unload_lora(self, name: str) -> None:
        """Refuse adapter `name` to new requests now; it leaves memory when its running ones end
        (engine thread; UnknownLoraError when not served). Loading: `loras.read`, then `loras.load`."""
        self.loras.unload(name, self._seqs.values())

    def lora_stats(self) -> LoraStats:
        """Adapters configured and resident, loads, evictions and requests per adapter."""
        lora = self.runner.lora
        stats = lora.stats() if lora is not None else LoraStats(configured=[], resident=[], loads=0, evictions=0)
        stats.requests = dict(self._lora_requests)
        return stats

    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache for this tokenizer (ValueError without xgrammar)."""
        return self.masking.grammars()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate and add a request (offline use; servers prepare on their own threads)."""
        self.add_prepared(request_id, self.prepare_prompt(prompt, params), params)

    def add_prepared(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival_time: float | None = None, grammar: Any = None) -> None:
        """Add a request whose prompt `prepare_prompt` validated. All or nothing: when it raises,
        the engine keeps no trace of the request. `arrival_time` (time.monotonic()) is when a
        server took it, if earlier than now; `grammar` its guide's compiled grammar, when a
        server compiled it ahead (else it is compiled here, waited for)."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Not validated again, but the adapter counts below are keyed by served names: an unknown
        # one (a prompt that skipped prepare_prompt) must not leave a half-added request.
        self.validator.check_lora(params)
        seq = Sequence(request_id, token_ids, params, next(self._arrivals),
                       rope_offset=self.runner.rope.offset_for(len(token_ids)),
                       pooling=self.config.embedding_pooling if params.embed else None)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, token_ids)
        matcher = self.masking.new_matcher(params.guide, grammar) if params.guide is not None else None
        self._seqs[request_id] = seq
        self._detokenizers[request_id] = detokenizer
        try:
            self.scheduler.add(seq)
        except BaseException:
            del self._seqs[request_id], self._detokenizers[request_id]
            raise
        if matcher is not None:
            self.masking.track(request_id, matcher)
        if params.lora_name is not None:
            self._lora_requests[params.lora_name] += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks now. Returns its final output, or None if
        it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        return self._finish(seq, FinishReason.ABORT, []) if seq is not None else None

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with finish_reason "error" and free its KV blocks now. Returns its
        final output (carrying `error`), or None if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        return self._fail(seq, error) if seq is not None else None

    def expire_waiting(self, max_wait_s: float, now: float) -> list[RequestOutput]:
        """End, with a "server busy" error, the requests that waited longer than `max_wait_s`
        without being started (not those preempted after they started)."""
        expired = [seq for seq in self.scheduler.waiting
                   if seq.num_cached_tokens is None and now - seq.arrival_time > max_wait_s]
        return [self._fail(seq, f"{SERVER_BUSY}: not started within max_queue_time_s={max_wait_s:g} s; "
                                "retry later") for seq in expired]

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued for their first step, or preempted."""
        return len(self.scheduler.waiting)

    def shutdown(self) -> None:
        """Stop the processes that outlive the object (tensor-parallel ranks, grammar compiler)
        and the KV event publisher's socket."""
        try:
            while self._in_flight:  # the later stages' replies are taken before they are told to stop
                self._in_flight.popleft()
                self.runner.collect()
        except Exception:
            log.exception("collecting the steps in flight at shutdown failed")
        self.runner.shutdown()
        self.masking.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def _start_kv_events(self, config: EngineConfig) -> KvEventPublisher | None:
        """The KV event publisher (None when kv_events_endpoint is unset)."""
        if not config.kv_events_endpoint:
            return None
        try:
            publisher = KvEventPublisher(config.kv_events_endpoint, config.kv_events_topic,
                                         config.kv_events_max_queue, config.kv_events_replica,
                                         config.kv_events_encoding)
        except BaseException:  # the endpoint is taken: stop what the engine started so far
            self.runner.shutdown()
            self.masking.close()
            raise
        return publisher

    def _tier_event(self, what: str, medium: str, chain_hash: bytes) -> None:
        """A block entering or leaving a tier below the pool (kv_tiers/), as a KV event of that
        medium; the tiers keep no tokens or parent, so a stored event carries the hash alone."""
        if what == "stored":
            self.kv_event_log.stored([chain_hash], None, [], self.config.block_size, None, None, medium)
        else:
            self.kv_event_log.removed(chain_hash, medium)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched and not yet collected (more than none between steps only with pipeline stages)."""
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        """Requests live, or steps in flight (to collect, even if their requests ended)."""
        return bool(self._seqs or self._in_flight)

    def stats(self) -> EngineStats:
        memory, disk = self.offload.used_bytes() if self.offload is not None else (0, 0)
        return EngineStats(kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_free=self.blocks.num_free_blocks,
                           kv_blocks_total=self.blocks.num_blocks, num_running=len(self.scheduler.running),
                           num_waiting=self.num_waiting, kv_tier_memory_bytes=memory, kv_tier_disk_bytes=disk)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled batch; the outputs of the requests it sampled."""
        return self.execute(self.schedule())

    def schedule(self) -> StepPlan:
        """Decide the step's chunks, make their LoRA adapters resident and build the batch."""
        start = time.perf_counter()
        self.last_step = None
        decision = self.scheduler.schedule()
        # Before the batch is built (a failed restore moves a chunk's start back) and the forward.
        tiers = self.offload.move(self.blocks, self.scheduler, decision.restores) if self.offload is not None else None
        if self.speculation is not None:
            for seq in decision.preempted:
                self.speculation.release(seq)
        failed = self._load_adapters(decision)
        batch = None
        if not decision.is_empty and self.config.pipeline_parallel_size > 1:
            # The stages must each have work: P micro-batches per step, or steps in flight.
            count = max(1, self.config.pipeline_parallel_size // self.steps_in_flight)
            batch = MicroBatches.build(decision.chunks, self.config.block_size, self.runner.device, count,
                                       self._stage_sampling)
        elif not decision.is_empty:
            batch = RaggedBatch.build(decision.chunks, self.config.block_size, self.runner.device)
        return StepPlan(decision, batch, failed, start, tiers)

    def execute(self, plan: StepPlan) -> list[RequestOutput]:
        """Run `plan`: forward, sample, update (append, stop, detokenize); the outputs. With
        pipeline stages up to `steps_in_flight` plans are in the pipe at once (step_plan.py):
        `plan` is launched, and the oldest collected once the pipe is full or `plan` has no batch."""
        self.runner.check()  # a failed rank group fails every step, this one too
        outputs = list(plan.failed)
        if plan.batch is not None:
            plan.tally.prompt_tokens = sum(_prompt_tokens(c) for c in plan.decision.chunks)
            plan.launched()
            forward_start = time.perf_counter()
            self.runner.launch(plan.batch)
            plan.tally.forward_s = time.perf_counter() - forward_start
            plan.embedded = self.pooler.take(plan.decision.chunks, self.runner.pooled_hidden)
            self.scheduler.advance(plan.decision)  # the next plan may take the prompts' next chunks
            self._in_flight.append(plan)
        if self._in_flight and (plan.batch is None or len(self._in_flight) >= self.steps_in_flight):
            outputs += self._collect(self._in_flight.popleft())
        return outputs

    def _collect(self, plan: StepPlan) -> list[RequestOutput]:
        """Sample (or take the last stage's tokens for) the oldest plan in flight and update."""
        tally = plan.tally
        forward_start = time.perf_counter()
        result = self.runner.collect()  # logits; or, with pipeline stages, the tokens the last stage sampled
        tally.forward_s += time.perf_counter() - forward_start
        sampled = result if isinstance(result, list) else self._sample(result, plan.sampling, tally)
        outputs = self._update(plan, sampled, tally)
        outputs += [self._embedded(seq, vector) for seq, vector in plan.embedded]
        self._publish_kv_events(tally)
        self._record(plan, tally)
        return outputs

    def _load_adapters(self, decision: SchedulerOutput) -> list[RequestOutput]:
        """Make the step's LoRA adapters resident. An adapter that cannot be read again fails
        its own requests, which leave the step; the others run."""
        if self.runner.lora is None:  # every step of an engine without adapters: nothing to look at
            return []
        names = sorted({c.seq.params.lora_name for c in decision.chunks} - {None})
        if not names:
            return []
        errors = {name: f"LoRA adapter {name!r} cannot be loaded: {e}"
                  for name, e in self.runner.acquire_adapters(names).items()}
        if not errors:
            return []
        log.error("%s", "; ".join(errors.values()))
        doomed = [c.seq for c in decision.chunks if c.seq.params.lora_name in errors]
        decision.chunks = [c for c in decision.chunks if c.seq.params.lora_name not in errors]
        return [self._fail(seq, errors[seq.params.lora_name]) for seq in doomed]

    def _stage_sampling(self, chunks: list[ScheduledChunk]) -> StageSampling:
        """What the last pipeline stage needs to sample `chunks`' rows; every constrained row's
        grammar mask is filled here, where the matchers are."""
        sampling = sampling_chunks(chunks)
        return StageSampling.build(sampling, sampling_rows(sampling), self.masking, self.sampler.eos_token_ids)

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledChunk],
                tally: StepTally) -> list[SampledToken | Exception]:
        """Per sampling row its token (or what sampling it raised), constrained rows within
        their grammar."""
        rows = sampling_rows(sampling)
        unmasked = []
        failed: dict[int, Exception] = {}  # rows whose grammar failed: their requests end alone
        if self.masking.active:
            mask_start = time.perf_counter()
            unmasked = self.masking.mask(logits, sampling, failed)
            tally.grammar_mask_s = time.perf_counter() - mask_start
        sampled, scores = sample_isolated(self.sampler, logits, rows) if rows else ([], [])
        for row, error in failed.items():
            sampled[row] = error
        if unmasked:
            mask_start = time.perf_counter()
            self.masking.repick(scores, sampled, unmasked)
            tally.grammar_mask_s += time.perf_counter() - mask_start
        return sampled

    def _update(self, plan: StepPlan, sampled: list[SampledToken | Exception],
                tally: StepTally) -> list[RequestOutput]:
        """Each sampling chunk's verified tokens appended (a failure in its sampling, stop check
        or text ends that request alone), then the next step's proposals; their outputs."""
        outputs = []
        row = 0
        for index, chunk in enumerate(plan.sampling):
            rows = sampled[row : row + 1 + chunk.num_draft_tokens]
            row += len(rows)
            if not plan.current(index, self._seqs):
                continue  # ended or preempted while its step was in flight
            try:
                tokens = verified_tokens(chunk, rows)
                tally.drafts += chunk.num_draft_tokens
                tally.accepted += len(tokens) - 1
                output = self._append_tokens(chunk.seq, tokens)
                tally.generated += len(output.delta_token_ids)  # fewer when a stop cut the run
                if chunk.num_draft_tokens:
                    self.speculation.settle(self.scheduler, chunk, len(tokens) - 1, output.finished)
                outputs.append(output)
            except Exception as e:
                log.exception("request %s failed; ending it alone", chunk.seq.request_id)
                outputs.append(self._fail(chunk.seq, f"{type(e).__name__}: {e}"))
        if self.speculation is not None:
            self.masking.cut_drafts(self.speculation.propose_next(self.scheduler))
        return outputs

    def _publish_kv_events(self, tally: StepTally) -> None:
        """Hand the step's KV events (blocks cached and evicted) to the publisher, which never waits."""
        if self.kv_event_publisher is None:
            return
        events = self.kv_event_log.take()
        tally.kv_events = len(events)
        tally.kv_event_batches_dropped = self.kv_event_publisher.publish(events)

    def _record(self, plan: StepPlan, tally: StepTally) -> None:
        duration_s = time.perf_counter() - plan.start
        self.scheduler.record_step(plan.batch.num_tokens, duration_s)
        decision = plan.decision
        self.last_step = StepStats(
            num_tokens=plan.batch.num_tokens, num_prompt_tokens=tally.prompt_tokens,
            num_generated_tokens=tally.generated, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_free=self.blocks.num_free_blocks, duration_s=duration_s, forward_s=tally.forward_s,
            num_preemptions=len(decision.preempted), prefix_cache_queries=decision.prefix_cache_queries,
            prefix_cache_hits=decision.prefix_cache_hits, spec_draft_tokens=tally.drafts,
            spec_accepted_tokens=tally.accepted, grammar_mask_s=tally.grammar_mask_s, kv_events=tally.kv_events,
            kv_event_batches_dropped=tally.kv_event_batches_dropped)
        if plan.tiers is not None:
            self.offload.record(plan.tiers, self.last_step)

    def _append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """Append the step's tokens one by one, stopping exactly where decoding them one per
        step would (EOS, stop token, max_tokens, context, stop string): the rest are dropped."""
        detok = self._detokenizers[seq.request_id]
        new_tokens: list[int] = []
        text = ""
        matcher = self.masking.get(seq.request_id)
        for token, logprob, top_logprobs in tokens:
            if matcher is not None:
                matcher.accept(token)
            seq.append_token(token, logprob, top_logprobs)
            new_tokens.append(token)
            reason = self.stop.check(seq, token, matcher)
            if reason is not None:
                return self._finish(seq, reason, new_tokens, text, detokenize=[token])
            step = detok.step([token], finished=False)
            text += step.delta_text
            if step.stop_matched:
                return self._finish(seq, FinishReason.STOP, new_tokens, text, detokenize=None)
        return request_output(seq, new_tokens, text, None, detok)

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int], text: str = "",
                detokenize: list[int] | None = ()) -> RequestOutput:
        """End `seq`: `text` is the new tokens' text so far, `detokenize` the tokens still to
        decode (None: the detokenizer has seen them all and its stop matched)."""
        seq.finish_reason = reason
        self._release(seq)
        detok = self._detokenizers.pop(seq.request_id)
        if detokenize is not None:
            text += detok.step(list(detokenize), finished=True).delta_text
        del self._seqs[seq.request_id]
        return request_output(seq, new_tokens, text, reason, detok)

    def _embedded(self, seq: Sequence, vector) -> RequestOutput:
        """End an embedding request whose prompt is computed (its KV blocks freed now)."""
        output = self._finish(seq, FinishReason.STOP, [], detokenize=None)
        output.embedding = vector
        return output

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Finish `seq` with an error, without its detokenizer (which may be what failed)."""
        seq.finish_reason = FinishReason.ERROR
        self._release(seq)  # safe after a partial _finish: freeing twice frees nothing
        self._detokenizers.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        return error_output(seq, error)

    def _release(self, seq: Sequence) -> None:
        """Free what a finished `seq` holds: its KV blocks, proposals and grammar matcher."""
        self.scheduler.finish(seq)
        if self.loras.unloading:
            self.loras.released(seq, seq.params.lora_name, self._seqs.values())
        if self.speculation is not None:
            self.speculation.release(seq)
        self.masking.forget(seq.request_id)
        self.pooler.forget(seq.request_id)

    def check_invariants(self) -> None:
        """Block-pool invariants over every live sequence (for tests)."""
        self.blocks.check_invariants(list(self._seqs.values()))


def _prompt_tokens(chunk: ScheduledChunk) -> int:
    """Prompt tokens `chunk` computes (before the scheduler advances past it)."""
    done = chunk.seq.num_computed_tokens
    return max(0, min(done + chunk.num_tokens, chunk.seq.num_prompt_tokens) - done)
