"""Drives an LLMEngine from a background thread, for servers.

Callers submit and abort from any thread; the engine thread applies those between steps
and hands each request's outputs to a few delivery threads, which call the request's callback
(a Triton response send is a round trip to the server process) while the engine goes on with
the next step. A step's outputs are handed over once the next step's batch is built, as its
forward pass starts (at once when no step follows): the delivery threads' Python then runs
while the engine thread is in the kernels, not against its scheduling for the GIL (bf16 served
at 16 clients: +3-7% req/s, alternating pairs). A request has at most one delivery in flight:
outputs produced meanwhile wait in its mailbox and go out merged into one (their deltas joined)
when the callback returns, so a slow consumer gets fewer, larger outputs instead of a growing
queue, and a request's outputs always arrive in order, its final one last (delivery.py).

The engine is built on the engine thread too, so that every OpenMP parallel region of the
process (loading and packing the weights, then every step) starts from that one thread. Each
thread that starts parallel regions gets its own OpenMP worker pool, and once a process holds
more OpenMP threads than cores, libgomp stops spinning between regions and puts its workers to
sleep: building the engine on the caller's thread and stepping it on this one doubled a
single-sequence decode step on 2 cores (11 -> 24 ms on the benchmark model).

A request with a guide (structured output) is admitted first (it counts as waiting at once),
then held here until its grammar compiles in the replica's compiler process, and only then
enters the engine: the engine thread and plain requests never wait behind a compile. Aborting
it meanwhile ends it at once ("abort"); a guide that fails ends it with an error starting
GUIDE_REFUSED.

Failures are contained at the smallest scope that explains them:
- one request (its sampling, stop check or text; its add or abort): that request ends with
  finish_reason "error" and its KV blocks are freed, the others go on (the engine does the
  per-request part of a step itself);
- a whole step (scheduling, the forward pass): every request in flight ends with an error, the
  loop goes on with the next requests;
- the engine's own bookkeeping (freeing a request fails, the block-pool invariants do not hold
  after a failure, or the loop itself raises), or its resources (`FatalEngineError`: a
  tensor-parallel rank died or hangs): the engine is broken. Every pending request
  ends with an error, every later `submit` raises `EngineFailedError`, and `failure` says why;
  the thread ends. Nothing waits forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine.delivery import Delivery, OutputCallback
from splitfuse.engine.llm_engine import EngineStats, LLMEngine, StepStats
from splitfuse.errors import GUIDE_REFUSED, SERVER_BUSY, EngineFailedError, FatalEngineError, ServerBusyError
from splitfuse.engine.sequence import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


__all__ = ["EngineLoop", "EngineStats", "StepStats", "OutputCallback"]


class EngineLoop:
    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None,
                 server: ServerConfig | None = None) -> None:
        self.config = config
        self.server = server if server is not None else ServerConfig()
        self.engine: LLMEngine | None = None
        self.on_step = on_step
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._lock = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self.steps = 0
        """Engine steps taken (engine thread): a watchdog that sees it stuck with work pending
        knows the engine hangs."""
        self._queued_adds = 0  # "add" commands in the inbox, and requests compiling (under _lock)
        self._compiling: dict[str, tuple] = {}  # request id -> its "add" command, until its grammar is ready
        self._engine_waiting = 0  # the engine's num_waiting after its last step (engine thread)
        self._failure: str | None = None
        self.resources_lost = False
        """The failure was a FatalEngineError (e.g. a tensor-parallel rank died or hangs): its
        bookkeeping is sound, so a new engine (a new engine process) would serve."""
        # stream_interval: undelivered outputs and when their oldest token was made (engine thread)
        self._held: dict[str, tuple[RequestOutput, float]] = {}
        # The last step's outputs, handed to the delivery threads when the next step's forward pass
        # starts (engine thread): their Python then runs while this thread is in the kernels rather
        # than competing for the GIL with its scheduling and batch building.
        self._step_outputs: list[RequestOutput] = []
        self._delivery = Delivery(on_callback_error=self.abort)
        self._thread = threading.Thread(target=self._run, name="splitfuse-engine", daemon=True)

    def start(self) -> LLMEngine:
        """Start the thread, build the engine on it and return the engine once it is ready
        (re-raising what building it raised)."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error
        return self.engine

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving for good; None while it is healthy."""
        return self._failure

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback) -> Future | None:
        """Validate (raising ValueError in the caller's thread) and enqueue a request; returns
        the future of its guide's grammar (None without a guide). Raises EngineFailedError once
        the engine is broken, RuntimeError while shutting down, ServerBusyError when full."""
        self._raise_if_failed()
        arrival = time.monotonic()
        self._check_room()  # before tokenizing: a refusal must cost the busy server nothing
        token_ids = self.engine.prepare_prompt(prompt, params)
        command = ("add", request_id, token_ids, params, arrival)
        # max_pending_guides: ServerBusyError before anything is held. Outside the lock: the first
        # guide builds the grammar cache (seconds), which the engine thread must not wait for.
        grammar = self.engine.grammars().compile_async(params.guide) if params.guide is not None else None
        if grammar is not None and grammar.done() and grammar.exception() is not None:
            raise ValueError(str(grammar.exception()))  # a remembered failure: refused at once
        with self._lock:
            self._raise_if_failed()
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._check_room()
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._callbacks[request_id] = on_output
            self._queued_adds += 1
            if grammar is None:
                self._inbox.append(command)
                self._lock.notify()
                return None
            self._compiling[request_id] = command
        grammar.add_done_callback(lambda future: self._grammar_ready(request_id, command, future))
        return grammar

    def _grammar_ready(self, request_id: str, command: tuple, grammar: Future) -> None:
        """The compile of a held request's guide ended (compiler's thread, or the caller's when it
        was done already): the request goes to the engine, or is refused."""
        error = grammar.exception()
        with self._lock:
            if self._compiling.get(request_id) is not command:  # aborted, or the engine failed
                return
            del self._compiling[request_id]
            self._inbox.append((*command, grammar.result()) if error is None
                               else ("refuse", request_id, f"{GUIDE_REFUSED}: {error}"))
            self._lock.notify()

    @property
    def num_waiting(self) -> int:
        """Requests taken but not running: submitted and not yet added, or waiting in the
        engine (as of its last step)."""
        return self._queued_adds + self._engine_waiting

    def _check_room(self) -> None:
        limit = self.server.max_waiting_requests
        waiting = self.num_waiting
        if limit and waiting >= limit:
            raise ServerBusyError(f"{SERVER_BUSY}: {waiting} requests are waiting (max_waiting_requests={limit}); "
                                  "retry later")

    def abort(self, request_id: str) -> None:
        with self._lock:
            held = self._compiling.pop(request_id, None)
            self._inbox.append(("abort", request_id) if held is None else ("cancel", request_id, held[2]))
            self._lock.notify()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread between steps; its result or exception in the future."""
        future: Future = Future()
        with self._lock:
            self._raise_if_failed()
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._inbox.append(("call", None, fn, future))
            self._lock.notify()
        return future

    def load_lora(self, name: str, path: str, timeout: float | None = None) -> None:
        """Serve the adapter in folder `path` (under lora_load_dir) as `name`; ValueError naming
        the field, nothing changed, when it cannot be. Read here, installed between steps."""
        adapter = self.engine.loras.read(name, path)
        self.call(lambda engine: engine.loras.load(adapter)).result(timeout)

    def unload_lora(self, name: str, timeout: float | None = None) -> None:
        """Refuse adapter `name` to new requests; its running ones finish with it."""
        self.call(lambda engine: engine.unload_lora(name)).result(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, abort what is in flight (callbacks see finish_reason "abort")."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"the engine failed and serves no more requests: {self._failure}")

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:  # handed to start()'s caller
            self._init_error = e
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except FatalEngineError as e:  # its resources are gone (a tensor-parallel rank died or hangs)
            log.exception("the engine is broken; failing every request")
            self._break(str(e), resources_lost=True)
        except BaseException as e:  # cleaning up after a failure failed: nothing is trusted now
            log.exception("the engine is broken; failing every request")
            self._break(_root_cause(e))
        finally:
            self._delivery.shutdown()
            try:
                self.engine.shutdown()
            except Exception:
                log.exception("shutting the engine down failed")

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished_requests():
                    self._lock.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            if stopping or any(command[0] != "add" for command in commands):
                self._hand_out()  # an abort's output must follow the request's earlier ones
            for command in commands:
                self._apply(command)
            self._expire_waiting()
            with self._lock:
                self._queued_adds -= sum(command[0] in _ADDS for command in commands)
                self._engine_waiting = self.engine.num_waiting
            if stopping:
                with self._lock:
                    held, self._compiling = self._compiling, {}
                    self._queued_adds -= len(held)
                    left = [request_id for request_id in self._callbacks if request_id not in held]
                for request_id, command in held.items():
                    self._apply(("cancel", request_id, command[2]))
                for request_id in left:
                    self._apply(("abort", request_id))
                return
            if not self.engine.has_unfinished_requests():
                self._hand_out()
                continue
            try:
                plan = self.engine.schedule()
                self._hand_out()  # the last step's outputs go out while this thread runs the forward pass
                outputs = self.engine.execute(plan)
                self.steps += 1
            except FatalEngineError:
                self._hand_out()
                raise
            except Exception as e:  # not tied to one request: every request in flight ends
                self._hand_out()
                log.exception("engine step failed; failing the requests in flight")
                self._fail_in_flight(f"engine step failed: {type(e).__name__}: {e}")
                continue
            self._step_outputs = outputs
            self._engine_waiting = self.engine.num_waiting
            if not self.engine.has_unfinished_requests():
                self._hand_out()
            if self.on_step is not None and self.engine.last_step is not None:
                try:
                    self.on_step(self.engine.last_step)
                except Exception:
                    log.exception("on_step callback failed")

    def _hand_out(self) -> None:
        """Deliver the last step's outputs (engine thread)."""
        outputs, self._step_outputs = self._step_outputs, []
        for out in outputs:
            self._deliver(out)

    def _apply(self, command: tuple) -> None:
        kind, request_id = command[0], command[1]
        if kind == "call":
            _run_call(self.engine, command[2], command[3])
            return
        try:
            if kind == "add":
                grammar = command[5] if len(command) > 5 else None
                self.engine.add_prepared(request_id, command[2], command[3], arrival_time=command[4], grammar=grammar)
                return
            if kind == "refuse":
                self._fail_request(request_id, command[2])
                return
            if kind == "cancel":  # aborted while its guide compiled: the engine never had it
                self._deliver(RequestOutput(request_id=request_id, prompt_token_ids=command[2], delta_token_ids=[],
                                            delta_text="", finished=True, finish_reason=FinishReason.ABORT.value))
                return
            out = self.engine.abort_request(request_id)
        except Exception as e:
            log.exception("%s of request %s failed; ending it with an error", kind, request_id)
            self._fail_request(request_id, f"{kind} failed: {type(e).__name__}: {e}")
            return
        if out is not None:
            self._deliver(out)
        else:
            with self._lock:
                self._callbacks.pop(request_id, None)

    def _expire_waiting(self) -> None:
        """max_queue_time_s: requests still not started past their deadline end "server busy"."""
        if self.server.max_queue_time_s > 0 and self.engine.num_waiting:
            for out in self.engine.expire_waiting(self.server.max_queue_time_s, time.monotonic()):
                self._deliver(out)

    def _fail_in_flight(self, error: str) -> None:
        with self._lock:
            # Not the requests submitted since the step began: they were not part of it.
            queued = {c[1] for c in self._inbox if c[0] in _ADDS} | set(self._compiling)
            in_flight = [request_id for request_id in self._callbacks if request_id not in queued]
        for request_id in in_flight:
            self._fail_request(request_id, error, check=False)
        self.engine.check_invariants()

    def _fail_request(self, request_id: str, error: str, check: bool = True) -> None:
        """End one request with an error and free its KV. When that raises, or the block pool
        is inconsistent afterwards, the exception reaches _run: the engine is broken."""
        out = self.engine.fail_request(request_id, error)
        self._deliver(out if out is not None else _error_output(request_id, error))
        if check:
            self.engine.check_invariants()

    def _break(self, reason: str, resources_lost: bool = False) -> None:
        with self._lock:
            self.resources_lost = resources_lost  # before the failure: a reader of both sees them agree
            self._failure = reason
            callbacks, self._callbacks = self._callbacks, {}
            self._inbox.clear()
            self._compiling.clear()
            self._queued_adds = 0
        error = f"the engine failed and serves no more requests: {reason}"
        for request_id, callback in callbacks.items():
            self._post(callback, _error_output(request_id, error))

    def _deliver(self, out: RequestOutput) -> None:
        """Hand `out` to its request's callback (engine thread). The callback is looked up, and
        for a final output forgotten, here; stream_interval may hold the output back."""
        out = self._coalesced(out)
        if out is None:
            return
        with self._lock:
            callback = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
        if callback is not None:
            self._post(callback, out)

    def _coalesced(self, out: RequestOutput) -> RequestOutput | None:
        """`out` with the request's held deltas in front, or None while it carries fewer than
        stream_interval new tokens and its oldest token is younger than stream_interval_max_ms
        (a request's first output and its last go at once)."""
        interval = self.server.stream_interval
        if interval == 1:
            return out
        now = time.monotonic()
        since = now
        held = self._held.pop(out.request_id, None)
        if held is not None:
            out, since = out.after(held[0]), held[1]
        max_wait = self.server.stream_interval_max_ms / 1e3
        if (out.finished or out.is_first or len(out.delta_token_ids) >= interval
                or (max_wait and now - since >= max_wait)):
            return out
        self._held[out.request_id] = (out, since)
        return None

    def _post(self, callback: OutputCallback, out: RequestOutput) -> None:
        self._delivery.post(callback, out)


_ADDS = ("add", "refuse", "cancel")  # commands that each end one request counted in _queued_adds


def _run_call(engine: LLMEngine, fn: Callable[[LLMEngine], Any], future: Future) -> None:
    try:
        future.set_result(fn(engine))
    except Exception as e:  # the caller's to handle (a refused load leaves the engine as it was)
        future.set_exception(e)


def _root_cause(e: BaseException, limit: int = 300) -> str:
    """The first exception of a chain (what went wrong, not the cleanup that then failed)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"[:limit]


def _error_output(request_id: str, error: str) -> RequestOutput:
    """Final output of a request the engine holds nothing of (any more)."""
    return RequestOutput(request_id=request_id, prompt_token_ids=[], delta_token_ids=[], delta_text="",
                         finished=True, finish_reason=FinishReason.ERROR.value, error=error)
