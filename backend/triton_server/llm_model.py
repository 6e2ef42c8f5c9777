"""The `llm` Triton model: the adapter between Triton's Python backend and the splitfuse engine
(decoupled: one response sender per request). model_repository/llm/1/model.py imports it.

`execute` only parses and enqueues; the engine runs on its own thread (EngineLoop) and each
request's outputs go out through that request's response sender as they are produced.
A housekeeping thread watches for cancelled requests and explicit stops, and publishes the
engine's metrics, so the engine thread does nothing but step and send.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import json
import logging
import secrets
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from splitfuse.config import split_parameters
from splitfuse.triton_server.control import Control
from splitfuse.triton_server import triton_log
from splitfuse.triton_server.live import Live
from splitfuse.triton_server.prompt_echo import PromptEcho
from splitfuse.triton_server.numa_placement import apply_numa, instance_index, log_cpu_placement
from splitfuse.engine.remote import RemoteEngine
from splitfuse.engine.wire import engine_facts
from splitfuse.errors import (ENGINE_FAULT, GUIDE_REFUSED, SERVER_BUSY, ServerBusyError, UnknownLoraError,
                              with_error_code)
from splitfuse.engine.sequence import RequestOutput
from splitfuse.triton_server.metrics import MetricsRecorder, TritonMetrics
from splitfuse.utils.orphan_guard import exit_with_parent
from splitfuse.triton_server.replica_balance import NOT_TAKING, ReplicaBalance
from splitfuse.triton_server.replica_failure import ReplicaFailure
from splitfuse.inputs import InputError
from splitfuse.triton_server.request import InputBounds, input_arrays, parse_request, wants_error_code
from splitfuse.triton_server.response import lora_ack_arrays, response_arrays, stop_ack_arrays
from splitfuse.triton_server.lora_admin import LoraAdmin

log = logging.getLogger("splitfuse.triton_server.llm")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# gRPC's names of the statuses this model answers with (errors.with_error_code), by TritonError's
# attribute: pb_utils has no TritonError while Triton auto-completes the config.
_STATUS_NAMES = {"INVALID_ARG": "INVALID_ARGUMENT", "NOT_FOUND": "NOT_FOUND", "UNAVAILABLE": "UNAVAILABLE",
                 "INTERNAL": "INTERNAL"}
# How often stop requests posted by other instances, run-time LoRA changes and the shutdown
# handshake are checked (files of the control folder). Each tick wakes this thread, and on a busy
# machine takes a core from an engine: at 10 ms two replicas' ticks were a quarter of the serving
# path's CPU (perf/results/2026-11-29-housekeeping).
HOUSEKEEPING_INTERVAL_S = 0.05
# How often metrics go to Triton (every update is a round trip to the server process;
# publishing at every tick cost ~10% of the throughput with 64 streams on 2 cores; a
# Prometheus scrape every few seconds sees no difference at half a second).
METRICS_INTERVAL_S = 0.5
# Cancellation is polled per request (one round trip to the server process each, holding the GIL
# the engine thread needs), at least this often, but slowed so that polling stays under ~1% of the
# time: with many requests in flight a sweep at every tick cost 20% of the throughput on a 2-core
# machine, and a 3% share was nearly a quarter of the serving path's CPU with 64 streams. A
# cancellation is then noticed within ~100 sweep times: 0.3-0.8 s with 32 requests live on a busy
# 2-core machine (perf/results/README.md, s34). The slowing stops at CANCEL_POLL_MAX_INTERVAL_S: a
# sweep's time includes waiting for the GIL behind the engine thread, so on a loaded machine the
# share alone pushed the next sweep seconds away, and a client that had left was noticed only
# after its generation had ended. Requests that came through the ensemble are never seen
# cancelled (Triton 2.51 does not forward it; tests/serving/test_cancel.py).
CANCEL_POLL_MIN_INTERVAL_S = 0.02
CANCEL_POLL_MAX_INTERVAL_S = 0.5
CANCEL_POLL_MAX_SHARE = 0.01
# How long `execute` holds on after refusing requests while the engine process restarts.
RESTARTING_PAUSE_S = 0.5


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        exit_with_parent()  # an orphaned stub ends at once (orphan_guard.py)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("llm needs `model_transaction_policy { decoupled: true }`")
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        self.model_name = args["model_name"]
        self.instance = args["model_instance_name"]
        # The engine's start-up lines (KV pool, backends, placement) into Triton's log.
        self.log_handler = triton_log.install(self.instance)
        config, self.server = split_parameters(params)
        # Before the engine's threads exist: they inherit the node's CPUs and memory policy.
        config, node = apply_numa(config, self.server, self.instance)
        if config.kv_events_endpoint:  # each replica publishes on its own port: the endpoint's + its index
            config = dataclasses.replace(config, kv_events_replica=instance_index(self.instance))
        self.config = config
        self.recorder = MetricsRecorder()
        self.loop, facts = self._start_engine(config)
        self.bounds = InputBounds.for_prompt_chars(facts.prompt_max_chars, facts.max_model_len)  # tensors' sizes
        labels = {"model": self.model_name, "version": args["model_version"], "instance": self.instance}
        self.metrics = TritonMetrics(labels)
        self.failure_reported = False
        self.was_taking = True
        self.live: dict[str, Live] = {}
        self.live_lock = threading.Lock()
        self.ids = itertools.count()
        self.control = Control(self.model_name, self.instance)
        # The launcher tells the OpenAI front (default max_tokens) what the KV cache allows.
        self.control.publish_limits(max_model_len=facts.max_model_len)
        self.lora_admin = LoraAdmin(self.loop, self.control.model_dir, self.control.stop_dir, self.control.tag,
                                    facts.lora_names)
        self.balance = ReplicaBalance(self.control.model_dir / "load", self.instance,
                                      self.server.replica_balance_max_wait_ms / 1e3)
        self.replica_failure = ReplicaFailure(self.model_name, self.instance,
                                              lambda: self.balance.least_peer_load() is not None,
                                              pb_utils.unload_model, pb_utils.Logger.log_error)
        self.stopping = threading.Event()
        self.housekeeper = threading.Thread(target=self._housekeeping, name="splitfuse-housekeeping", daemon=True)
        self.housekeeper.start()
        log_cpu_placement(node, facts.threads)
        pb_utils.Logger.log_info(
            f"{self.instance}: splitfuse engine ready"
            f"{f' in its own process (pid {facts.pid})' if self.remote else ''}: {facts.runner_line}; "
            f"{config}; {self.server}")

    def _start_engine(self, config) -> tuple:
        """The engine: in a child process (engine_process), else on this process's own thread;
        (its driver, its facts). With the engine in its own process, this process loads no torch and
        no tokenizer until a prompt sent as ids is to be echoed (PromptEcho)."""
        if self.server.engine_process:
            loop = RemoteEngine(config, on_step=self.recorder.step, server=self.server, name=self.instance)
            facts = loop.start()
            self.echo = PromptEcho(tokenizer_dir=facts.tokenizer)
            self.remote = loop
            self.lora_stats = loop.lora_stats
            return loop, facts
        from splitfuse.engine.loop import EngineLoop  # torch: only a replica with the engine in its process loads it

        loop = EngineLoop(config, on_step=self.recorder.step, server=self.server)
        engine = loop.start()  # built on the engine's own thread
        self.echo = PromptEcho(tokenizer=engine.tokenizer)
        self.remote = None
        self.lora_stats = engine.lora_stats
        return loop, engine_facts(engine)

    def execute(self, requests: list) -> None:
        if self.replica_failure.refusing:
            for request in requests:
                self._send_error(request.get_response_sender(), self.replica_failure.refusal(),
                                 pb_utils.TritonError.UNAVAILABLE, wants_error_code(request.parameters()))
            self.replica_failure.hold(self.control.draining)
            return None
        for request in requests:
            sender = request.get_response_sender()
            coded = wants_error_code(request.parameters())
            try:
                self._start(request, sender, coded)
            except ValueError as e:  # InputError, SamplingParams, the engine's own validation
                self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG, coded)
            except ServerBusyError as e:  # max_waiting_requests: refused at once, nothing queued
                self.recorder.refused("queue_full")
                self._send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE, coded)
            except RuntimeError as e:  # the engine is shutting down, or failed for good (EngineFailedError)
                self._send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE, coded)
            except Exception as e:  # never let one request take down the others
                log.exception("unexpected error handling a request")
                self._send_error(sender, f"internal error: {type(e).__name__}: {e}",
                                 pb_utils.TritonError.INTERNAL, coded)
        # Holding more than another replica: take no more for now, so Triton gives the next
        # requests to the others (replica_balance.py). Not while draining: all are refused.
        if not self.control.draining():
            waited = self.balance.wait_turn(self._held)
            if waited:
                self.recorder.balance_wait(waited)
        if self.remote is not None and self.remote.restarting:
            # It refuses everything meanwhile: a pause, so Triton gives the next requests to the
            # other replicas rather than to this one, the idlest.
            self.remote.wait_serving(RESTARTING_PAUSE_S)
        return None

    def _held(self) -> int:
        return len(self.live)

    def _post_load(self) -> None:
        """What this replica holds, for the others (a failed or restarting engine takes no more)."""
        self.balance.post(self._held() if self._taking() else NOT_TAKING)

    def _taking(self) -> bool:
        return self.loop.failure is None and not (self.remote is not None and self.remote.restarting)

    def finalize(self) -> None:
        # Aborts what is in flight; each aborted request still gets its final response.
        self.loop.shutdown(timeout=30.0)
        self.stopping.set()
        self.housekeeper.join(timeout=5.0)
        self.balance.close()
        self.control.close()
        self.metrics.close()
        triton_log.uninstall(self.log_handler)

    # ---- requests ----------------------------------------------------------------------------
    def _start(self, request, sender, coded: bool) -> None:
        parsed = parse_request(input_arrays(request.inputs(), self.bounds), self.server.default_temperature)
        client_id = request.request_id() or ""
        if parsed.stop_request:
            self._stop(parsed.stop_handle, sender)
            return
        if parsed.lora_admin is not None:  # ValueError (the caller's INVALID_ARG): nothing changed
            self._lora_request(parsed.lora_admin, sender, coded)
            return
        engine_id = f"{client_id}#{next(self.ids)}"
        if self.control.draining():  # the file itself, not the housekeeper's copy: no 10 ms window
            raise RuntimeError("the server is shutting down")
        if parsed.return_num_cached_tokens and not (self.server.report_num_cached_tokens
                                                     or parsed.params.cache_salt is not None):
            raise InputError("num_cached_tokens is reported only for requests with a cache_salt on this server "
                             "(it would tell whether another client sent the same prompt; the operator can allow "
                             "it with the report_num_cached_tokens parameter)")
        lora = parsed.params.lora_name
        names = self.lora_admin.names
        if lora is not None and lora not in names:  # here: refused even when the queue is full
            served = ", ".join(names) if names else "none (no lora_modules parameter)"
            raise InputError(f"lora_name: unknown LoRA adapter {lora!r}; this server's adapters: {served}")
        # Unguessable, and led by this instance's tag so that a stop landing on another instance
        # finds it (request ids are the client's choice: any client could reuse another's).
        handle = f"{self.control.tag}.{secrets.token_hex(16)}"
        live = Live(engine_id, handle, sender, parsed, arrival=time.perf_counter(),
                    echo_pending=not parsed.exclude_input, handle_pending=parsed.return_stop_handle,
                    error_code=coded)
        with self.live_lock:
            self.live[engine_id] = live
            self._post_load()
        try:
            # A guide compiles after admission, off this thread (the loop holds the request meanwhile).
            grammar = self.loop.submit(engine_id, parsed.prompt, parsed.params,
                                       lambda out: self._on_output(live, out))
        except BaseException:
            with live.lock:  # the caller sends the final (error) response
                live.done = True
            with self.live_lock:
                self.live.pop(engine_id, None)
                self._post_load()
            raise
        if grammar is not None:
            grammar.add_done_callback(lambda _: self.recorder.constrained(time.perf_counter() - live.arrival))

    def _stop(self, handle: str, sender) -> None:
        """Stop the generation that `handle` names, wherever it runs; the answer is the same
        whether or not it exists (a stop tells nothing about others' generations)."""
        owner = handle.split(".", 1)[0]
        if owner == self.control.tag:
            self._abort_handle(Control.key(handle))
        else:
            self.control.post_stop(owner, Control.key(handle))
        sender.send(_response(stop_ack_arrays()), flags=FINAL)

    def _lora_request(self, op: tuple, sender, coded: bool) -> None:
        """A run-time LoRA load or unload: here, then on the other instances (lora_admin.py)."""
        try:
            message = self.lora_admin.apply(op)
        except UnknownLoraError as e:
            self._send_error(sender, str(e), pb_utils.TritonError.NOT_FOUND, coded)
            return
        sender.send(_response(lora_ack_arrays(message)), flags=FINAL)

    def _abort_handle(self, stop_key: str) -> None:
        with self.live_lock:
            victims = [lv for lv in self.live.values()
                       if not lv.cancelled and hmac.compare_digest(Control.key(lv.stop_handle), stop_key)]
            for lv in victims:
                lv.cancelled = True
        for lv in victims:
            self.loop.abort(lv.engine_id)

    def _send_error(self, sender, message: str, code: int, coded: bool) -> None:
        if coded:
            name = next((grpc for attr, grpc in _STATUS_NAMES.items() if getattr(pb_utils.TritonError, attr) == code),
                        "UNKNOWN")
            message = with_error_code(message, name)
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code)),
                        flags=FINAL)
        except Exception:
            log.exception("could not send an error response")

    # ---- engine thread -------------------------------------------------------------------------
    def _on_output(self, live: Live, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.delta_token_ids:
            self.recorder.tokens(live.arrival, live.last_token, len(out.delta_token_ids), now)
            live.last_token = now
        if out.finished:
            self.recorder.finished(out, live.arrival, now)
        try:
            if out.finished:
                with live.lock:
                    try:
                        if out.error is not None:  # failed inside the engine
                            self._send_error(live.sender, out.error, self._error_code(out.error), live.error_code)
                        elif live.error is not None:
                            self._send_error(live.sender, live.error, pb_utils.TritonError.INTERNAL, live.error_code)
                        else:
                            error = self._send(live, out)
                            if error is not None:
                                self._send_error(live.sender, error, pb_utils.TritonError.INTERNAL, live.error_code)
                    finally:
                        live.done = True
            elif live.parsed.stream and live.error is None:
                live.error = self._send(live, out)
                if live.error is not None and not live.cancelled:  # its final response carries the error
                    live.cancelled = True
                    self.loop.abort(live.engine_id)
        finally:
            if out.finished:  # only now: the shutdown handshake waits for `live` to empty
                with self.live_lock:
                    self.live.pop(live.engine_id, None)
                    self._post_load()

    def _error_code(self, error: str) -> int:
        # Busy (max_queue_time_s), or the engine broke for good: like a server that is away, retry
        # elsewhere. Else this request alone failed.
        if error.startswith(SERVER_BUSY):
            self.recorder.refused("queue_time")
            return pb_utils.TritonError.UNAVAILABLE
        if error.startswith(GUIDE_REFUSED):  # the client's guide did not compile
            return pb_utils.TritonError.INVALID_ARG
        if error.startswith(ENGINE_FAULT):  # this replica's engine process died or hung: retry
            return pb_utils.TritonError.UNAVAILABLE
        return pb_utils.TritonError.UNAVAILABLE if self.loop.failure is not None else pb_utils.TritonError.INTERNAL

    def _send(self, live: Live, out: RequestOutput) -> str | None:
        """Send one response; returns why, when this request's response could not be built."""
        echo = None
        if live.echo_pending:  # exclude_input_in_output=false: the prompt leads the first response
            live.echo_pending = False
            echo = self.echo.text(live.parsed, out.prompt_token_ids)
        handle = None
        if live.handle_pending:
            live.handle_pending = False
            handle = live.stop_handle
        try:
            response = _response(response_arrays(live.parsed, out, echo, handle))
        except Exception as e:
            log.exception("%s: building a response for %s failed", self.instance, live.engine_id)
            return f"could not build the response: {type(e).__name__}: {e}"
        try:
            live.sender.send(response, flags=FINAL if out.finished else 0)
        except Exception as e:
            # The client is gone: stop generating for it.
            log.warning("%s: sending a response for %s failed (%s); aborting it", self.instance, live.engine_id, e)
            if not out.finished and not live.cancelled:
                live.cancelled = True
                self.loop.abort(live.engine_id)
        return None

    # ---- housekeeping thread -------------------------------------------------------------------
    def _housekeeping(self) -> None:
        next_sweep = next_metrics = 0.0
        while not self.stopping.wait(HOUSEKEEPING_INTERVAL_S):
            try:
                now = time.perf_counter()
                if now >= next_sweep:
                    self._check_cancelled()
                    took = time.perf_counter() - now
                    wait = min(CANCEL_POLL_MAX_INTERVAL_S, max(CANCEL_POLL_MIN_INTERVAL_S, took / CANCEL_POLL_MAX_SHARE))
                    next_sweep = now + wait
                self.balance.touch()
                for stop_key in self.control.take_stops():
                    self._abort_handle(stop_key)
                self.lora_admin.take_posted()
                self._shutdown_handshake()
                if now >= next_metrics:
                    next_metrics = now + METRICS_INTERVAL_S
                    self._publish_metrics()
            except Exception:
                log.exception("housekeeping failed")

    def _shutdown_handshake(self) -> None:
        if not self.control.draining():
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
        with self.live_lock:
            pending = len(self.live)
        # The launcher's watchdog reads it; operators find the engine process's pid there.
        self.control.beat(self.loop.steps, pending, self.remote.engine_pid if self.remote is not None else None)
        taking = self._taking()
        if taking != self.was_taking:  # an engine restart began or ended: the other replicas are told
            self.was_taking = taking
            with self.live_lock:
                self._post_load()
        self.metrics.record_faults(self.control.faults())  # what the launcher's restarts cost so far
        failure = self.loop.failure
        if failure is not None and not self.failure_reported:
            self.failure_reported = True
            with self.live_lock:
                self._post_load()
            self.replica_failure.failed(failure)
        self.replica_failure.tick()
        self.metrics.publish(self.recorder.drain(), self.loop.stats(), healthy=failure is None)
        if self.remote is not None:
            self.metrics.publish_engine_faults(self.remote)
        lora_stats = self.lora_stats() if self.config.lora_modules or self.config.lora_load_dir else None
        if lora_stats is not None:
            self.metrics.publish_lora(lora_stats)


def _response(arrays: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, a) for name, a in arrays.items()])
