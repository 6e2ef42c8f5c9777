"""Drives an LLMEngine from a background thread, for servers.

Callers submit and abort from any thread; the engine thread applies those between steps
and hands each request's outputs to its callback as they are produced.

The engine is built on the engine thread too, so that every OpenMP parallel region of the
process (loading and packing the weights, then every step) starts from that one thread. Each
thread that starts parallel regions gets its own OpenMP worker pool, and once a process holds
more OpenMP threads than cores, libgomp stops spinning between regions and puts its workers to
sleep: building the engine on the caller's thread and stepping it on this one doubled a
single-sequence decode step on 2 cores (11 -> 24 ms on the benchmark model).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from splitfuse.config import EngineConfig
from splitfuse.engine import EngineStats, LLMEngine, StepStats
from splitfuse.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]

__all__ = ["EngineLoop", "EngineStats", "StepStats", "OutputCallback"]


class EngineLoop:
    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None) -> None:
        self.config = config
        self.engine: LLMEngine | None = None
        self.on_step = on_step
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._lock = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="splitfuse-engine", daemon=True)

    def start(self) -> LLMEngine:
        """Start the thread, build the engine on it and return the engine once it is ready
        (re-raising what building it raised)."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error
        return self.engine

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback) -> None:
        """Validate (raising ValueError in the caller's thread) and enqueue a request."""
        token_ids = self.engine.prepare_prompt(prompt, params)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._callbacks[request_id] = on_output
            self._inbox.append(("add", request_id, token_ids, params))
            self._lock.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, abort what is in flight (callbacks see finish_reason "abort")."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:  # handed to start()'s caller
            self._init_error = e
            return
        finally:
            self._ready.set()
        while True:
            with self._lock:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished_requests():
                    self._lock.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for command in commands:
                self._apply(command)
            if stopping:
                for request_id in list(self._callbacks):
                    self._apply(("abort", request_id))
                return
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a failing step must not take the server down with it
                log.exception("engine step failed; aborting the requests in flight")
                for request_id in list(self._callbacks):
                    self._apply(("abort", request_id))
                continue
            for out in outputs:
                self._deliver(out)
            if self.on_step is not None and self.engine.last_step is not None:
                try:
                    self.on_step(self.engine.last_step)
                except Exception:
                    log.exception("on_step callback failed")

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, token_ids, params = command
            self.engine.add_prepared(request_id, token_ids, params)
            return
        request_id = command[1]
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        else:
            with self._lock:
                self._callbacks.pop(request_id, None)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            callback = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
        if callback is None:
            return
        try:
            callback(out)
        except Exception:
            log.exception("output callback for %s failed; aborting it", out.request_id)
            if not out.finished:
                self.abort(out.request_id)
