"""Triton adapter for the splitfuse engine (decoupled: one response sender per request).

`execute` only parses and enqueues; the engine runs on its own thread (EngineLoop) and each
request's outputs go out through that request's response sender as they are produced.
A housekeeping thread watches for cancelled requests and explicit stops, and publishes the
engine's metrics, so the engine thread does nothing but step and send.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from splitfuse.config import EngineConfig
from splitfuse.control import Control
from splitfuse.engine_loop import EngineLoop, StepStats
from splitfuse.sequence import RequestOutput
from splitfuse.triton_request import InputError, Parsed, parse_request

log = logging.getLogger("splitfuse.triton.llm")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often stop requests and the shutdown handshake are checked.
HOUSEKEEPING_INTERVAL_S = 0.01
# How often metrics go to Triton (every update is a round trip to the server process;
# publishing at every tick cost ~10% of the throughput with 64 streams on 2 cores; a
# Prometheus scrape every few seconds sees no difference at half a second).
METRICS_INTERVAL_S = 0.5
# Cancellation is polled per request (one round trip to the server process each, holding the
# GIL the engine thread needs), at least this often, but slowed so that polling stays under
# ~3% of the time: with many requests in flight a sweep at every tick cost 20% of the
# throughput on a 2-core machine; with a 10% share, 16 clients served 1.95-2.00 req/s against
# 2.13-2.17 with polling off (single noisy runs). A cancellation is noticed within ~30 sweep
# times (about 0.1 s with 16 requests live).
CANCEL_POLL_MIN_INTERVAL_S = 0.02
CANCEL_POLL_MAX_SHARE = 0.03

TOKENS_PER_STEP_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]


# --------------------------------------------------------------------------- live requests


@dataclass
class Live:
    """A request in the engine: where its responses go and what it asked for."""

    engine_id: str
    client_key: str
    """Control.key of the client's request id."""
    sender: Any
    parsed: Parsed
    arrival: float
    """time.perf_counter() at arrival, for latencies."""
    arrival_wall: float
    """time.time() at arrival, to compare with when a stop was posted."""
    last_token: float | None = None
    cancelled: bool = False
    echo_pending: bool = False
    done: bool = False
    """The final response went out. Guarded by `lock`: after the final flag Triton frees the
    response factory, and is_cancelled() on it then crashes the whole server (2.51)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Metrics:
    """Prometheus metrics through Triton, labelled by model, version and instance.

    The MetricFamily objects are kept on self: a Metric whose family was garbage-collected
    fails on every update.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        MF = pb_utils.MetricFamily
        self.families = {
            "kv": MF(name="splitfuse_kv_cache_blocks", description="KV-cache blocks by state", kind=MF.GAUGE),
            "req": MF(name="splitfuse_requests", description="Requests in the engine by state", kind=MF.GAUGE),
            "tps": MF(name="splitfuse_tokens_per_step", description="Tokens in each engine step (forward pass)",
                      kind=MF.HISTOGRAM),
            "prompt": MF(name="splitfuse_prompt_tokens_total", description="Prompt tokens computed",
                         kind=MF.COUNTER),
            "gen": MF(name="splitfuse_generation_tokens_total", description="Tokens generated", kind=MF.COUNTER),
            "pc_queries": MF(name="splitfuse_prefix_cache_queries_total",
                             description="Prompt tokens looked up in the prefix cache", kind=MF.COUNTER),
            "pc_hits": MF(name="splitfuse_prefix_cache_hits_total",
                          description="Prompt tokens found in the prefix cache (KV reused)", kind=MF.COUNTER),
            "ttft": MF(name="splitfuse_time_to_first_token_seconds",
                       description="Time from request arrival to its first generated token", kind=MF.HISTOGRAM),
            "itl": MF(name="splitfuse_inter_token_latency_seconds",
                      description="Time between consecutive generated tokens of a request", kind=MF.HISTOGRAM),
        }
        f = self.families
        self.kv_used = f["kv"].Metric(labels={**labels, "state": "used"})
        self.kv_free = f["kv"].Metric(labels={**labels, "state": "free"})
        self.running = f["req"].Metric(labels={**labels, "state": "running"})
        self.waiting = f["req"].Metric(labels={**labels, "state": "waiting"})
        self.tokens_per_step = f["tps"].Metric(labels=labels, buckets=TOKENS_PER_STEP_BUCKETS)
        self.prompt_tokens = f["prompt"].Metric(labels=labels)
        self.generation_tokens = f["gen"].Metric(labels=labels)
        self.prefix_cache_queries = f["pc_queries"].Metric(labels=labels)
        self.prefix_cache_hits = f["pc_hits"].Metric(labels=labels)
        self.ttft = f["ttft"].Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.itl = f["itl"].Metric(labels=labels, buckets=ITL_BUCKETS)
        self._gauges: dict[str, float] = {}

    def set_gauge(self, name: str, value: float) -> None:
        # Each update is a round trip to the server process: skip unchanged values.
        if self._gauges.get(name) != value:
            self._gauges[name] = value
            getattr(self, name).set(value)

    def close(self) -> None:
        # Metrics before their families (see the class docstring).
        for name in ("kv_used", "kv_free", "running", "waiting", "tokens_per_step", "prompt_tokens",
                     "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "ttft", "itl"):
            setattr(self, name, None)
        self.families.clear()


# --------------------------------------------------------------------------- the model


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("llm needs `model_transaction_policy { decoupled: true }`")
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        config = EngineConfig.from_strings(params)
        self.model_name = args["model_name"]
        self.instance = args["model_instance_name"]
        self.step_stats: deque[StepStats] = deque()
        self.loop = EngineLoop(config, on_step=self.step_stats.append)
        self.engine = self.loop.start()  # built on the engine's own thread
        self.tokenizer = self.engine.tokenizer
        labels = {"model": self.model_name, "version": args["model_version"], "instance": self.instance}
        self.metrics = Metrics(labels)
        self.first_token_latencies: deque[float] = deque()
        self.inter_token_latencies: deque[float] = deque()
        self.live: dict[str, Live] = {}
        self.live_lock = threading.Lock()
        self.ids = itertools.count()
        self.control = Control(self.model_name, self.instance)
        self.draining = False
        self.stopping = threading.Event()
        self.housekeeper = threading.Thread(target=self._housekeeping, name="splitfuse-housekeeping", daemon=True)
        self.housekeeper.start()
        runner = self.engine.runner
        pb_utils.Logger.log_info(
            f"{self.instance}: splitfuse engine ready: device={runner.device} "
            f"dtype={str(runner.dtype).removeprefix('torch.')} attention_backend={runner.attention_backend} "
            f"linear_backend={runner.linear_backend} threads={torch.get_num_threads()}; {config}")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._start(request, sender)
            except ValueError as e:  # InputError, SamplingParams, the engine's own validation
                self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            except RuntimeError as e:  # e.g. the engine is shutting down
                self._send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
            except Exception as e:  # never let one request take down the others
                log.exception("unexpected error handling a request")
                self._send_error(sender, f"internal error: {type(e).__name__}: {e}",
                                 pb_utils.TritonError.INTERNAL)
        return None

    def finalize(self) -> None:
        # Aborts what is in flight; each aborted request still gets its final response.
        self.loop.shutdown(timeout=30.0)
        self.stopping.set()
        self.housekeeper.join(timeout=5.0)
        self.control.close()
        self.metrics.close()

    # ---- requests ----------------------------------------------------------------------------
    def _start(self, request, sender) -> None:
        parsed = parse_request({t.name(): t.as_numpy() for t in request.inputs()})
        client_id = request.request_id() or ""
        if parsed.stop_request:
            self._stop(client_id, sender)
            return
        engine_id = f"{client_id}#{next(self.ids)}"
        if self.draining:
            raise RuntimeError("the server is shutting down")
        live = Live(engine_id, Control.key(client_id), sender, parsed, arrival=time.perf_counter(),
                    arrival_wall=time.time(), echo_pending=not parsed.exclude_input)
        with self.live_lock:
            self.live[engine_id] = live
        try:
            self.loop.submit(engine_id, parsed.prompt, parsed.params, lambda out: self._on_output(live, out))
        except BaseException:
            with live.lock:  # the caller sends the final (error) response
                live.done = True
            with self.live_lock:
                self.live.pop(engine_id, None)
            raise

    def _stop(self, client_id: str, sender) -> None:
        if not client_id:
            raise InputError("a stop request needs the request id of the generation to stop")
        self.control.post_stop(client_id)
        self._abort_client(Control.key(client_id), time.time())
        response = pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[b""]], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([[b"abort"]], dtype=np.object_)),
        ])
        sender.send(response, flags=FINAL)

    def _abort_client(self, client_key: str, posted: float) -> None:
        with self.live_lock:
            # Only generations that arrived before the stop, so a reused id is not hit later
            # (with slack for the file system's coarse timestamps).
            victims = [lv for lv in self.live.values()
                       if lv.client_key == client_key and not lv.cancelled and lv.arrival_wall <= posted + 0.05]
            for lv in victims:
                lv.cancelled = True
        for lv in victims:
            self.loop.abort(lv.engine_id)

    def _send_error(self, sender, message: str, code: int) -> None:
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code)),
                        flags=FINAL)
        except Exception:
            log.exception("could not send an error response")

    # ---- engine thread -------------------------------------------------------------------------
    def _on_output(self, live: Live, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.delta_token_ids:
            if live.last_token is None:
                self.first_token_latencies.append(now - live.arrival)
            else:
                gap = (now - live.last_token) / len(out.delta_token_ids)
                self.inter_token_latencies.extend([gap] * len(out.delta_token_ids))
            live.last_token = now
        try:
            if out.finished:
                with live.lock:
                    try:
                        self._send(live, out)
                    finally:
                        live.done = True
            elif live.parsed.stream:
                self._send(live, out)
        finally:
            if out.finished:  # only now: the shutdown handshake waits for `live` to empty
                with self.live_lock:
                    self.live.pop(live.engine_id, None)

    def _send(self, live: Live, out: RequestOutput) -> None:
        p = live.parsed
        if p.stream:
            text, ids, logprobs = out.delta_text, out.delta_token_ids, out.delta_logprobs
        else:
            text, ids, logprobs = out.text, out.token_ids, out.logprobs
        if live.echo_pending:
            # exclude_input_in_output=false: the prompt leads the first (or only) response.
            live.echo_pending = False
            text = self._prompt_text(live, out) + text
            ids = list(out.prompt_token_ids) + list(ids)
        tensors = [
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32).reshape(1, -1)),
            pb_utils.Tensor("finish_reason", np.array([[(out.finish_reason or "").encode()]], dtype=np.object_)),
        ]
        if p.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([[len(out.prompt_token_ids)]], np.int32)))
        if p.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[len(out.token_ids)]], np.int32)))
        if p.return_num_cached_tokens:
            tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([[out.num_cached_tokens]], np.int32)))
        if p.return_log_probs:
            tensors.append(pb_utils.Tensor("log_probs", np.array(logprobs or [], np.float32).reshape(1, -1)))
        try:
            live.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if out.finished else 0)
        except Exception as e:
            # The client is gone (or the response could not be built): stop generating for it.
            log.warning("%s: sending a response for %s failed (%s); aborting it", self.instance, live.engine_id, e)
            if not out.finished and not live.cancelled:
                live.cancelled = True
                self.loop.abort(live.engine_id)

    def _prompt_text(self, live: Live, out: RequestOutput) -> str:
        if live.parsed.prompt_text is not None:
            return live.parsed.prompt_text
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)

    # ---- housekeeping thread -------------------------------------------------------------------
    def _housekeeping(self) -> None:
        next_sweep = next_metrics = 0.0
        while not self.stopping.wait(HOUSEKEEPING_INTERVAL_S):
            try:
                now = time.perf_counter()
                if now >= next_sweep:
                    self._check_cancelled()
                    took = time.perf_counter() - now
                    next_sweep = now + max(CANCEL_POLL_MIN_INTERVAL_S, took / CANCEL_POLL_MAX_SHARE)
                for client_key, posted in self.control.read_stops():
                    self._abort_client(client_key, posted)
                self._shutdown_handshake()
                if now >= next_metrics:
                    next_metrics = now + METRICS_INTERVAL_S
                    self._publish_metrics()
            except Exception:
                log.exception("housekeeping failed")

    def _shutdown_handshake(self) -> None:
        self.draining = self.control.draining()
        if not self.draining:
            return
        if self.control.aborting():
            with self.live_lock:
                victims = [lv for lv in self.live.values() if not lv.cancelled]
                for lv in victims:
                    lv.cancelled = True
            for lv in victims:
                self.loop.abort(lv.engine_id)
        with self.live_lock:
            idle = not self.live
        self.control.set_idle(idle)

    def _check_cancelled(self) -> None:
        with self.live_lock:
            candidates = [lv for lv in self.live.values() if not lv.cancelled]
        for lv in candidates:
            with lv.lock:
                if lv.done:
                    continue
                try:
                    cancelled = lv.sender.is_cancelled()
                except Exception:
                    continue
            if cancelled:
                lv.cancelled = True
                self.loop.abort(lv.engine_id)

    def _publish_metrics(self) -> None:
        m = self.metrics
        prompt = generated = cache_queries = cache_hits = 0
        while self.step_stats:
            s = self.step_stats.popleft()
            m.tokens_per_step.observe(s.num_tokens)
            prompt += s.num_prompt_tokens
            generated += s.num_generated_tokens
            cache_queries += s.prefix_cache_queries
            cache_hits += s.prefix_cache_hits
        if prompt:
            m.prompt_tokens.increment(prompt)
        if generated:
            m.generation_tokens.increment(generated)
        if cache_queries:
            m.prefix_cache_queries.increment(cache_queries)
        if cache_hits:
            m.prefix_cache_hits.increment(cache_hits)
        while self.first_token_latencies:
            m.ttft.observe(self.first_token_latencies.popleft())
        while self.inter_token_latencies:
            m.itl.observe(self.inter_token_latencies.popleft())
        # Gauges from the engine's own counters: they are right even when no step follows an abort.
        st = self.loop.stats()
        m.set_gauge("kv_used", st.kv_blocks_used)
        m.set_gauge("kv_free", st.kv_blocks_free)
        m.set_gauge("running", st.num_running)
        m.set_gauge("waiting", st.num_waiting)
