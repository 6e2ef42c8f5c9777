"""The step loop: requests in, one scheduled forward pass per step, outputs out.

    schedule -> build ragged batch -> run model -> sample -> append / stop check -> detokenize

Single-threaded by design; `EngineLoop` (engine_loop.py) drives it from a background
thread for servers, `LLM` (llm.py) drives it inline for offline use.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from splitfuse.engine.block_manager import BlockManager
from splitfuse.config import EngineConfig
from splitfuse.engine.detokenizer import IncrementalDetokenizer
from splitfuse.errors import SERVER_BUSY
from splitfuse.lora.registry import LoraStats
from splitfuse.engine.model_runner import ModelRunner
from splitfuse.models.gguf_checkpoint import prepare_checkpoint
from splitfuse.inputs import PromptLimit
from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.sampler import Sampler
from splitfuse.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from splitfuse.engine.sequence import FinishReason, RequestOutput, SamplingParams, Sequence, TopLogprobs
from splitfuse.spec_decode.ngram import NgramProposer
from splitfuse.spec_decode.decoder import SpeculativeDecoder, sampling_rows
from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.matcher import Matcher, masks_before_sampling

log = logging.getLogger(__name__)

# A constrained row sampled before masking whose token its grammar refuses: how many of its
# best-scored tokens are tried before its whole mask is filled (a fill costs ~20x a check). SmolLM2
# under the bench's JSON schema: 17% of rows refused; 8 candidates left 34% of those to the whole
# mask, 32 left 16%, 256 left 6% for 2x the checks.
REPICK_CANDIDATES = 32

SampledToken = tuple[int, float | None, TopLogprobs | None]
"""What one sampling row yields: the token, its log-prob and its top alternatives (each None
unless the request asks for it)."""


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


@dataclass
class EngineStats:
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int


def with_checkpoint_dirs(config: EngineConfig) -> EngineConfig:
    """`config` with each GGUF file it names (model, tokenizer, draft model) replaced by its
    converted checkpoint directory (converted once, models/gguf_checkpoint.py)."""
    model = prepare_checkpoint(config.model)
    tokenizer = model if config.tokenizer == config.model else prepare_checkpoint(config.tokenizer)
    draft = config.speculative_model and prepare_checkpoint(config.speculative_model)
    if (model, tokenizer, draft) == (config.model, config.tokenizer, config.speculative_model):
        return config
    return dataclasses.replace(config, model=model, tokenizer=tokenizer, speculative_model=draft)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = with_checkpoint_dirs(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.prompt_limit = PromptLimit(self.tokenizer, self.max_model_len)
        self.vocab_size = self.runner.args.vocab_size
        self.blocks = BlockManager(self.runner.num_kv_blocks, config.block_size, config.kv_watermark,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.token_budget, config.max_num_seqs, config.scheduler_policy,
                                   config.speculative_disable_batch_size, max_loras=config.max_loras,
                                   prompt_order=config.prompt_order,
                                   first_token_deadline_tokens_per_s=config.first_token_deadline_tokens_per_s)
        self._lora_requests: dict[str, int] = {name: 0 for name in self.lora_names()}
        self.speculation = _speculative_decoder(config, self.max_model_len, self.vocab_size)
        self.eos_token_ids = set(_generation_eos_ids(config.model) or self.runner.args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._grammars: GrammarCache | None = None  # built at the first constrained request
        self._grammars_lock = threading.Lock()
        self._matchers: dict[str, Matcher] = {}
        self._arrivals = itertools.count()
        self.last_step: StepStats | None = None

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a request and return its prompt token ids. Raises ValueError naming the
        field. Thread-safe: servers call it on their own threads before enqueuing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_lora(params)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.prompt_limit.check(prompt)
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        if params.guide is not None:
            self.grammars().compile(params.guide)  # here, off the engine thread; cached by text
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context (max_model_len={self.max_model_len})"
            )
        # (max_model_len is at most what the KV pool holds for one sequence, ModelRunner's
        # _fit_max_model_len: a request that passes fits the pool on its own, so preemption can
        # always make room for it.)
        return token_ids

    def _check_lora(self, params: SamplingParams) -> None:
        if params.lora_name is not None and params.lora_name not in self._lora_requests:
            served = ", ".join(self._lora_requests)
            raise ValueError(f"unknown LoRA adapter {params.lora_name!r}; "
                             + (f"this engine serves: {served}" if served else "no LoRA adapters are configured"))

    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name (SamplingParams.lora_name), as configured."""
        return self.runner.lora.names if self.runner.lora is not None else []

    def lora_stats(self) -> LoraStats:
        """Adapters configured and resident, loads, evictions and requests per adapter."""
        lora = self.runner.lora
        stats = lora.stats() if lora is not None else LoraStats(configured=[], resident=[], loads=0, evictions=0)
        stats.requests = dict(self._lora_requests)
        return stats

    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache for this tokenizer (ValueError without xgrammar)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.tokenizer, self.vocab_size)
            return self._grammars

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.prepare_prompt(prompt, params)
        self.add_prepared(request_id, token_ids, params)

    def add_prepared(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival_time: float | None = None) -> None:
        """Add a request whose prompt `prepare_prompt` already validated. All or nothing: when
        it raises, the engine keeps no trace of the request. `arrival_time` (time.monotonic())
        is when a server took it, if earlier than now."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check_lora(params)
        seq = Sequence(request_id, token_ids, params, next(self._arrivals))
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, token_ids)
        matcher = self.grammars().matcher(params.guide) if params.guide is not None else None
        self._seqs[request_id] = seq
        self._detokenizers[request_id] = detokenizer
        try:
            self.scheduler.add(seq)
        except BaseException:
            del self._seqs[request_id], self._detokenizers[request_id]
            raise
        if matcher is not None:
            self._matchers[request_id] = matcher
        if params.lora_name is not None:
            self._lora_requests[params.lora_name] += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks now. Returns its final output, or None if
        it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT, [])

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with finish_reason "error" and free its KV blocks now. Returns its
        final output (carrying `error`), or None if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._fail(seq, error)

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
        """Release what outlives the object (the other tensor-parallel ranks' processes, the
        grammar compiler's)."""
        self.runner.shutdown()
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_free=self.blocks.num_free_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=self.num_waiting,
        )

    # ---- the step -------------------------------------------------------------------------
    def step(self, before_forward: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One forward pass over the scheduled batch; the outputs of the requests it sampled.
        `before_forward` runs once the batch is built, just before the forward pass (a server
        hands out the previous step's outputs there, while this thread leaves the GIL to them)."""
        start = time.perf_counter()
        self.last_step = None
        decision = self.scheduler.schedule()
        if self.speculation is not None:
            for seq in decision.preempted:
                self.speculation.release(seq)
        failed = self._load_adapters(decision)
        if decision.is_empty:
            return failed
        chunks = decision.chunks
        sampling = [c for c in chunks if c.samples]
        batch = RaggedBatch.build(chunks, self.config.block_size, self.runner.device)
        if before_forward is not None:
            before_forward()
        forward_start = time.perf_counter()
        logits = self.runner.execute(batch)
        forward_s = time.perf_counter() - forward_start
        rows = sampling_rows(sampling)
        grammar_mask_s = 0.0
        unmasked: list[tuple[int, Matcher]] = []
        if self._matchers:
            mask_start = time.perf_counter()
            unmasked = self._mask_constrained(logits, sampling)
            grammar_mask_s = time.perf_counter() - mask_start
        sampled, scores = self._sample(logits, rows) if rows else ([], [])
        if unmasked:
            mask_start = time.perf_counter()
            self._repick_refused(scores, sampled, unmasked)
            grammar_mask_s += time.perf_counter() - mask_start
        num_prompt_tokens = 0
        for c in chunks:
            done = c.seq.num_computed_tokens
            num_prompt_tokens += max(0, min(done + c.num_tokens, c.seq.num_prompt_tokens) - done)
        self.scheduler.advance(decision)
        outputs = failed
        num_generated = num_drafts = num_accepted = 0
        row = 0
        for chunk in sampling:
            seq = chunk.seq
            group = sampled[row : row + 1 + chunk.num_draft_tokens]
            row += len(group)
            try:
                accepted = self._verified_tokens(chunk, group)
                num_drafts += chunk.num_draft_tokens
                num_accepted += len(accepted) - 1
                output = self._append_tokens(seq, accepted)
                num_generated += len(output.delta_token_ids)  # fewer when a stop cut the run
                if chunk.num_draft_tokens:
                    self.speculation.record(seq, chunk.num_draft_tokens, len(accepted) - 1)
                    if not output.finished:
                        self.scheduler.accept_drafts(seq, len(accepted) - 1)
                outputs.append(output)
            except Exception as e:  # sampling, stop check or detokenizing of this request alone
                log.exception("request %s failed; ending it alone", seq.request_id)
                outputs.append(self._fail(seq, f"{type(e).__name__}: {e}"))
        if self.speculation is not None:
            self._propose()
        duration_s = time.perf_counter() - start
        self.scheduler.record_step(batch.num_tokens, duration_s)
        self.last_step = StepStats(
            num_tokens=batch.num_tokens,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=num_generated,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_free=self.blocks.num_free_blocks,
            duration_s=duration_s,
            forward_s=forward_s,
            num_preemptions=len(decision.preempted),
            prefix_cache_queries=decision.prefix_cache_queries,
            prefix_cache_hits=decision.prefix_cache_hits,
            spec_draft_tokens=num_drafts,
            spec_accepted_tokens=num_accepted,
            grammar_mask_s=grammar_mask_s,
        )
        return outputs

    def _load_adapters(self, decision: SchedulerOutput) -> list[RequestOutput]:
        """Make the step's LoRA adapters resident. An adapter that cannot be read again (its
        folder changed or vanished since the start) fails its own requests, which leave the
        step; the others run."""
        lora = self.runner.lora
        if lora is None:  # every step of an engine without adapters: nothing to look at
            return []
        names = sorted({c.seq.params.lora_name for c in decision.chunks} - {None})
        if not names:
            return []
        errors: dict[str, str] = {}
        for name in names:  # one by one: the ones loaded stay the most recently used, never evicted here
            try:
                lora.acquire([name])
            except (ValueError, OSError) as e:
                log.error("LoRA adapter %r cannot be loaded: %s", name, e)
                errors[name] = f"LoRA adapter {name!r} cannot be loaded: {e}"
        if not errors:
            return []
        doomed = [c.seq for c in decision.chunks if c.seq.params.lora_name in errors]
        decision.chunks = [c for c in decision.chunks if c.seq.params.lora_name not in errors]
        return [self._fail(seq, errors[seq.params.lora_name]) for seq in doomed]

    @staticmethod
    def _verified_tokens(chunk: ScheduledChunk, rows: list) -> list[SampledToken]:
        """The tokens (with their log-probs and alternatives, each from its own row) a sampling
        chunk yields: the proposals its rows confirmed, then the token sampled where the first
        one failed (or after the last). Raises what sampling a needed row raised."""
        drafts = chunk.seq.draft_token_ids[: chunk.num_draft_tokens]
        out: list[SampledToken] = []
        for i, row in enumerate(rows):
            if isinstance(row, Exception):
                raise row
            out.append(row)
            if i == len(drafts) or row[0] != drafts[i]:
                break
        return out

    def _mask_constrained(self, logits, sampling: list[ScheduledChunk]) -> list[tuple[int, Matcher]]:
        """Mask the constrained rows that must be masked before sampling to the tokens their
        grammar allows next (after each of its proposed tokens, for a speculative chunk), one
        bitmask applied in one call. Returns the other constrained rows (row, matcher): sampled
        first, checked after (`masks_before_sampling`)."""
        grammars = self.grammars()
        bitmask = None
        rows: list[int] = []
        unmasked: list[tuple[int, Matcher]] = []
        row = 0
        for chunk in sampling:
            matcher = self._matchers.get(chunk.seq.request_id)
            if matcher is None:
                pass
            elif masks_before_sampling(chunk.seq.params, chunk.num_draft_tokens):
                if bitmask is None:
                    bitmask = grammars.new_bitmask(logits.shape[0])
                rows += matcher.fill_drafts_(bitmask, row, chunk.seq.draft_token_ids[: chunk.num_draft_tokens])
            else:
                unmasked.append((row, matcher))
            row += 1 + chunk.num_draft_tokens
        if rows:
            with torch.inference_mode():  # the logits are the forward pass's inference tensors
                grammars.apply_bitmask_(logits, bitmask, rows)
        return unmasked

    def _repick_refused(self, scores: list, sampled: list, unmasked: list[tuple[int, Matcher]]) -> None:
        """The rows sampled before masking whose token their grammar refuses get the token they
        would have drawn masked (SamplerOutput.scores), in place in `sampled`: the best-scored
        allowed token among the first few, else the argmax of the row's scores under its whole
        mask (log-probs: none, such rows are masked before sampling)."""
        for row, matcher in unmasked:
            got = sampled[row]
            if isinstance(got, Exception) or matcher.allows(got[0]):
                continue
            row_scores = scores[row]
            values, ids = row_scores.topk(min(REPICK_CANDIDATES, row_scores.shape[0]))
            token = matcher.first_allowed(ids[values > float("-inf")].tolist())
            if token is None:
                grammars = self.grammars()
                bitmask = grammars.new_bitmask(1)
                matcher.fill_(bitmask, 0)
                masked = row_scores[None].clone()
                grammars.apply_bitmask_(masked, bitmask, [0])
                token = int(masked.argmax())
            sampled[row] = (token, *got[1:])

    def _propose(self) -> None:
        """Proposals for the sequences the next step decodes, if it may speculate; a constrained
        sequence's are cut at the first token its grammar refuses (verification would reject it)."""
        decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        if not self.scheduler.may_speculate(len(decoding)):
            for seq in decoding:
                seq.draft_token_ids = []
            return
        self.speculation.propose(decoding)
        for seq in decoding:
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None and seq.draft_token_ids:
                del seq.draft_token_ids[matcher.allowed_prefix(seq.draft_token_ids):]

    def _sample(self, logits, seqs: list[Sequence]) -> tuple[list[SampledToken | Exception], list]:
        """Per sampling row: (token, log-prob, top log-probs), or what sampling that row raised;
        and per row its scores (SamplerOutput.scores; None for a row that raised).

        The batch is sampled in one call; only when that raises is each row sampled alone, so
        that a failure tied to one request (its parameters, its logits) fails that request
        and not the batch. Seeded rows draw the same tokens either way (their noise depends on
        seed and position only)."""
        try:
            out = self.sampler(logits, seqs)
            return list(zip(out.token_ids, out.logprobs, out.top_logprobs)), out.scores
        except Exception:
            log.exception("sampling a batch of %d failed; sampling each request alone", len(seqs))
        rows: list[SampledToken | Exception] = []
        scores: list = []
        for i, seq in enumerate(seqs):
            try:
                out = self.sampler(logits[i : i + 1], [seq])
                rows.append((out.token_ids[0], out.logprobs[0], out.top_logprobs[0]))
                scores.append(out.scores[0])
            except Exception as e:
                rows.append(e)
                scores.append(None)
        return rows, scores

    def _append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """Append the step's tokens one by one, stopping exactly where decoding them one per
        step would (EOS, stop token, max_tokens, context, stop string): the rest are dropped."""
        params = seq.params
        detok = self._detokenizers[seq.request_id]
        new_tokens: list[int] = []
        text = ""
        matcher = self._matchers.get(seq.request_id)
        for token, logprob, top_logprobs in tokens:
            if matcher is not None:
                matcher.accept(token)
            seq.append_token(token, logprob, top_logprobs)
            new_tokens.append(token)
            reason = None
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                reason = FinishReason.STOP
            elif matcher is not None and matcher.terminated:  # the grammar is complete (ignore_eos or not)
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                return self._finish(seq, reason, new_tokens, text, detokenize=[token])
            step = detok.step([token], finished=False)
            text += step.delta_text
            if step.stop_matched:
                return self._finish(seq, FinishReason.STOP, new_tokens, text, detokenize=None)
        return self._output(seq, new_tokens, text, None)

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int], text: str = "",
                detokenize: list[int] | None = ()) -> RequestOutput:
        """End `seq`: `text` is the new tokens' text so far, `detokenize` the tokens still to
        decode (None: the detokenizer has seen them all and its stop matched)."""
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        if self.speculation is not None:
            self.speculation.release(seq)
        self._matchers.pop(seq.request_id, None)
        detok = self._detokenizers.pop(seq.request_id)
        if detokenize is not None:
            text += detok.step(list(detokenize), finished=True).delta_text
        del self._seqs[seq.request_id]
        return self._output(seq, new_tokens, text, reason, detok)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Finish `seq` with an error, without its detokenizer (which may be what failed)."""
        seq.finish_reason = FinishReason.ERROR
        self.scheduler.finish(seq)  # safe after a partial _finish: freeing twice frees nothing
        if self.speculation is not None:
            self.speculation.release(seq)
        self._detokenizers.pop(seq.request_id, None)
        self._matchers.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            delta_token_ids=[],
            delta_text="",
            finished=True,
            finish_reason=FinishReason.ERROR.value,
            seq_token_ids=seq.token_ids,
            num_tokens=len(seq.token_ids),
            error=error,
        )

    def _output(self, seq: Sequence, new_tokens: list[int], delta_text: str, reason: FinishReason | None,
                detokenizer: IncrementalDetokenizer | None = None) -> RequestOutput:
        want_logprobs = seq.params.logprobs
        want_top = seq.params.top_logprobs > 0
        detok = detokenizer or self._detokenizers[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            delta_token_ids=new_tokens,
            delta_text=delta_text,
            finished=reason is not None,
            finish_reason=reason.value if reason is not None else None,
            delta_logprobs=seq.output_logprobs[-len(new_tokens):] if want_logprobs and new_tokens else None,
            delta_top_logprobs=seq.output_top_logprobs[-len(new_tokens):] if want_top and new_tokens else None,
            seq_token_ids=seq.token_ids,
            num_tokens=len(seq.token_ids),
            seq_logprobs=seq.output_logprobs if want_logprobs else None,
            seq_top_logprobs=seq.output_top_logprobs if want_top else None,
            text_source=detok,
            text_len=detok.text_length,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def check_invariants(self) -> None:
        """Block-pool invariants over every live sequence (for tests)."""
        self.blocks.check_invariants(list(self._seqs.values()))


def _speculative_decoder(config: EngineConfig, max_model_len: int, vocab_size: int) -> SpeculativeDecoder | None:
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from splitfuse.spec_decode.draft import DraftModelProposer

        proposer = DraftModelProposer(config, vocab_size)
    return SpeculativeDecoder(config, proposer, max_model_len)


def _generation_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json, which HF generate() stops on."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
