"""The stub's side of an engine in its own process (issue 59, docs/engine_process.md).

`RemoteEngine` has EngineLoop's surface (`submit`, `abort`, `failure`, `stats`, `num_waiting`,
`steps`, `shutdown`) and drives an EngineLoop in a child process (core_process.py) over a pipe.
One long-lived supervising thread per replica starts the child (PR_SET_PDEATHSIG fires when the
thread that started a child ends), reads everything the child sends, and watches it:

- the child died (end of file on the pipe: SIGKILL, a segfault, a memory limit), or it hangs (no
  engine step for `step_timeout_s` while it holds work: it is killed): every request of this
  replica ends at once with an error starting ENGINE_FAULT, new ones are refused meanwhile
  (`restarting`), and a new child starts;
- the child's engine lost its resources (a tensor-parallel rank, a child of the child, died or
  hangs: EngineLoop's FatalEngineError): its requests end at once as above, naming that error,
  the child is told to shut down (killed if it has not within `_BROKEN_GRACE_S`), and a new
  child, with new ranks, starts;
- more than `engine_restarts` restarts within `engine_restart_window_s`: this replica fails for
  good (`failure`), as a broken in-process engine does.

Each request's outputs arrive as records (wire.py), are rebuilt into RequestOutputs and handed to
its callback on the delivery threads (delivery.py), as EngineLoop does in process.
"""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine import wire
from splitfuse.engine.delivery import Delivery, OutputCallback
from splitfuse.engine.sequence import FinishReason, SamplingParams
from splitfuse.errors import ENGINE_FAULT, EngineFailedError, ServerBusyError, UnknownLoraError
from splitfuse.inputs import InputError
from splitfuse.utils import children
from splitfuse.utils.restarts import RestartBudget, exit_description

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""For the engine to load its weights (a large GGUF file converts once, then memory-maps)."""
_POLL_S = 0.05
_STALE_S = 1.0  # a child's "idle" is believed this long (it sends a batch every 0.25 s)
_BROKEN_GRACE_S = 10.0  # for a child whose engine broke to send its last outputs and exit
# The exceptions the child's answers name, rebuilt here (any other: RuntimeError).
_ERRORS = {"ValueError": ValueError, "InputError": InputError, "ServerBusyError": ServerBusyError,
           "EngineFailedError": EngineFailedError, "UnknownLoraError": UnknownLoraError}


class _Call:
    """A submit waiting for the child's answer."""

    __slots__ = ("request_id", "done", "answer", "grammar")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.done = threading.Event()
        self.answer: tuple = (None, "", False)
        self.grammar: Future | None = None
        """Its guide's compile (set by the supervisor before `done`: the end may follow at once)."""


class RemoteEngine:
    def __init__(self, config: EngineConfig, on_step: Callable | None = None, server: ServerConfig | None = None,
                 name: str = "llm") -> None:
        self.config = config
        self.server = server if server is not None else ServerConfig()
        self.on_step = on_step
        self.name = name
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[wire.Stream, OutputCallback]] = {}
        self._grammars: dict[str, Future] = {}
        self._calls: dict[int, _Call] = {}
        self._runtime_loras: dict[str, str] = {}  # loaded at run time: a restarted child loads them again
        self._call_ids = itertools.count()
        self._delivery = Delivery(on_callback_error=self.abort)
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._failure: str | None = None
        self._stopping = False
        self._started = threading.Event()
        self._start_error: str | None = None
        self.facts: wire.EngineFacts | None = None
        self._serving = threading.Event()
        self.restarting = True
        """No child serves now (starting, or restarting after a fault): submits are refused."""
        self._progress = wire.Progress()
        self._progress_at = 0.0  # monotonic time of the last batch
        self._stalled_since = 0.0  # since when no step was seen while work was held
        self._restart_budget = RestartBudget(self.server.engine_restarts, self.server.engine_restart_window_s)
        self.restarts = 0
        self.fault_failed_requests = 0
        self.last_recovery_s = 0.0
        self._fault_at = 0.0
        self._broken: tuple[str, float] | None = None
        """The child's engine lost its resources: (why, when)."""
        self._thread = threading.Thread(target=self._supervise, name="splitfuse-engine-supervisor", daemon=True)

    # ---- EngineLoop's surface ------------------------------------------------------------------
    def start(self) -> wire.EngineFacts:
        """Start the supervising thread and the first child; the engine's facts once it serves."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(self._start_error)
        return self.facts

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def steps(self) -> int:
        return self._progress.step_count

    @property
    def num_waiting(self) -> int:
        return self._progress.num_waiting

    @property
    def engine_pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and not self.restarting else None

    def wait_serving(self, timeout: float) -> bool:
        """Until a child serves (True) or `timeout` seconds pass."""
        return self._serving.wait(timeout)

    def stats(self):
        return self._progress.stats

    def lora_stats(self):
        return self._progress.lora_stats

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback) -> Future | None:
        """As EngineLoop.submit, answered by the child (its exceptions rebuilt here)."""
        call = _Call(request_id)
        with self._lock:
            if self._failure is not None:
                raise EngineFailedError(f"the engine failed and serves no more requests: {self._failure}")
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if self.restarting:
                raise RuntimeError(f"{self.name}: the engine process is restarting after a fault; retry")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (wire.Stream(), on_output)  # outputs may come before the answer
            call_id = next(self._call_ids)
            self._calls[call_id] = call
        self._send((wire.SUBMIT, call_id, request_id, prompt, params))
        call.done.wait()
        error, message, _ = call.answer
        if error is not None:
            with self._lock:
                self._streams.pop(request_id, None)
            raise _ERRORS.get(error, RuntimeError)(message)
        return call.grammar

    def abort(self, request_id: str) -> None:
        self._send((wire.ABORT, request_id))

    def load_lora(self, name: str, path: str, timeout: float | None = None) -> None:
        """As EngineLoop.load_lora, in the child (its exceptions rebuilt here)."""
        self._lora_call("load", name, path, timeout)

    def unload_lora(self, name: str, timeout: float | None = None) -> None:
        self._lora_call("unload", name, None, timeout)

    def _lora_call(self, op: str, name: str, path: str | None, timeout: float | None) -> None:
        call = _Call("")
        with self._lock:
            if self.restarting or self._failure is not None or self._stopping:
                raise RuntimeError(f"{self.name}: the engine process is not serving now; retry")
            call_id = next(self._call_ids)
            self._calls[call_id] = call
        self._send((wire.LORA, call_id, op, name, path))
        if not call.done.wait(timeout):
            with self._lock:
                self._calls.pop(call_id, None)
            raise RuntimeError(f"{self.name}: the engine process did not answer the LoRA {op} in {timeout} s")
        error, message, _ = call.answer
        if error is not None:
            raise _ERRORS.get(error, RuntimeError)(message)
        if op == "load":
            self._runtime_loras[name] = path
        else:
            self._runtime_loras.pop(name, None)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: the child aborts what is in flight (callbacks see finish_reason "abort")."""
        with self._lock:
            self._stopping = True
        self._send((wire.SHUTDOWN, timeout))
        self._thread.join(timeout)
        self._delivery.shutdown()

    def _send(self, message: tuple) -> None:
        """To the child; lost when it is gone (the supervisor ends what it held)."""
        with self._send_lock:
            conn = self._conn
            if message[0] == wire.SUBMIT:
                with self._lock:  # a submit the supervisor already ended must not reach the next child
                    if message[1] not in self._calls:
                        return
            if conn is None:
                self._fail_call_of(message)
                return
            try:
                conn.send(message)
            except (OSError, ValueError):
                self._fail_call_of(message)

    def _fail_call_of(self, message: tuple) -> None:
        if message[0] in (wire.SUBMIT, wire.LORA):
            self._answer(message[1], ("RuntimeError", f"{ENGINE_FAULT}: it is gone; retry", False))

    def _answer(self, call_id: int, answer: tuple) -> None:
        with self._lock:
            call = self._calls.pop(call_id, None)
            if call is not None and answer[0] is None and answer[2]:  # its guide compiles in the child
                call.grammar = self._grammars[call.request_id] = Future()
        if call is not None:
            call.answer = answer
            call.done.set()

    # ---- supervising thread --------------------------------------------------------------------
    def _supervise(self) -> None:
        """Start the child, serve its messages, and after a fault start another (this thread
        owns every child: the kernel kills a child when the thread that started it ends)."""
        while not self._stopping:
            began = time.monotonic()
            if not self._start_child():
                return
            if self.restarts:
                self.last_recovery_s = time.monotonic() - self._fault_at
                log.warning("%s: a new engine process (pid %d) serves, %.1f s after the fault (%.1f s to start)",
                            self.name, self._process.pid, self.last_recovery_s, time.monotonic() - began)
            if self._stopping:  # shut down while this child started: it is told now
                self._send((wire.SHUTDOWN, None))
            reason = self._serve_child()
            with self._lock:
                stopping = self._stopping
            if stopping:
                self._end_child(reason)
                return
            self._fault_at = self._broken[1] if self._broken else time.monotonic()
            self._end_child(reason)
            if not self._may_restart():
                return
            self.restarts += 1

    def _start_child(self) -> bool:
        """A new child, serving; False when it could not start (the replica failed for good)."""
        ours, theirs = Pipe()
        try:
            process = subprocess.Popen([children.python_executable(), "-m", "splitfuse.engine.core_process",
                                        str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                       preexec_fn=children.die_with_parent())
        except OSError as e:
            return self._give_up(f"the engine process could not start: {e}")
        finally:
            theirs.close()
        self._process = process
        ours.send((self.config, self.server, self.name))
        hello = self._first_word(ours)
        if not hello or hello[0] != wire.HELLO:
            process.kill()
            how = hello[1] if hello and hello[0] == wire.START_FAILED else exit_description(process.wait())
            return self._give_up(f"the engine process did not start: {how}")
        self.facts = hello[1]
        self._progress, self._progress_at, self._stalled_since = wire.Progress(), time.monotonic(), 0.0
        with self._send_lock:
            self._conn = ours
        for name, path in self._runtime_loras.items():  # (a request naming one at once may find it not yet back)
            with self._lock:
                call_id = next(self._call_ids)
                self._calls[call_id] = _Call("")
            self._send((wire.LORA, call_id, "load", name, path))
        with self._lock:
            self.restarting = False
        self._serving.set()
        self._started.set()
        return True

    @staticmethod
    def _first_word(conn: Connection) -> tuple | None:
        """The child's HELLO or START_FAILED (None: it died or said nothing in time); the log
        records it sends while it builds the engine go to this process's log meanwhile."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while conn.poll(max(0.0, deadline - time.monotonic())):
            message = wire.receive(conn)
            if message is None or message[0] != wire.LOG:
                return message
            wire.log_record(message)
        return None

    def _give_up(self, reason: str) -> bool:
        log.error("%s: %s", self.name, reason)
        with self._lock:
            self._failure = reason
        self._start_error = reason
        self._started.set()
        return False

    def _serve_child(self) -> str | None:
        """Dispatch the child's messages until it ends; why it ended (None: asked to)."""
        conn = self._conn
        while True:
            if conn.poll(_POLL_S):
                message = wire.receive(conn)
                if message is None:
                    code = self._process.wait()
                    if self._stopping:
                        return None
                    return f"its engine failed: {self._broken[0]}" if self._broken else \
                        f"it exited ({exit_description(code)})"
                self._dispatch(message)
            hung = self._hang()
            if hung is not None:
                self._process.send_signal(signal.SIGKILL)
                self._process.wait()
                return hung

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == wire.BATCH:
            self._take_batch(message[1])
        elif kind == wire.REPLY:
            self._answer(message[1], message[2:])
        elif kind == wire.GRAMMAR:
            with self._lock:
                future = self._grammars.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == wire.LOG:
            wire.log_record(message)
        elif kind == wire.FAILED:
            self._engine_failed(message[1], message[2])

    def _engine_failed(self, reason: str, resources_lost: bool) -> None:
        """The child's engine is broken. Its bookkeeping: the replica fails for good, as in
        process. Its resources (FatalEngineError): a new child rebuilds them, so it is a fault."""
        if not resources_lost:
            log.error("%s: the engine is broken: %s", self.name, reason)
            with self._lock:
                self._failure = reason
            return
        log.error("%s: the engine lost its resources: %s; starting a new engine process", self.name, reason)
        with self._lock:
            self.restarting = True  # refused from now on; the child's own refusals would say "for good"
            self._broken = (reason, time.monotonic())
            self._serving.clear()
        # Ended here, as a fault (retryable), rather than by the child's "serves no more requests".
        self._end_requests(f"its engine failed: {reason}")
        self._send((wire.SHUTDOWN, _BROKEN_GRACE_S))

    def _take_batch(self, progress: wire.Progress) -> None:
        now = time.monotonic()
        if progress.step_count != self._progress.step_count or not progress.busy:
            self._stalled_since = 0.0
        self._progress, self._progress_at = progress, now
        for record in progress.records:
            request_id, finished = record[0], record[3]
            with self._lock:
                entry = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
                grammar = self._grammars.pop(request_id, None) if finished else None
            if grammar is not None:  # ended (refused, aborted) before its GRAMMAR message came
                grammar.set_result(None)
            if entry is not None:
                self._delivery.post(entry[1], entry[0].apply(record))
        if self.on_step is not None:
            for stats in progress.steps:
                try:
                    self.on_step(stats)
                except Exception:
                    log.exception("on_step callback failed")

    def _hang(self) -> str | None:
        """Why the child counts as hung: it holds work (or its last word is old) and made no
        step for step_timeout_s, or its engine broke and it has not exited; None otherwise."""
        now = time.monotonic()
        if self._broken is not None:
            reason, at = self._broken
            return f"its engine failed: {reason}; it did not exit, killed" if now - at > _BROKEN_GRACE_S else None
        with self._lock:
            held = bool(self._streams)
        fresh = now - self._progress_at < _STALE_S
        if not held or (fresh and not self._progress.busy):
            self._stalled_since = 0.0
            return None
        if not self._stalled_since:
            self._stalled_since = now
        stalled = now - self._stalled_since
        if stalled < self.server.step_timeout_s:
            return None
        return f"it hung: no engine step for {stalled:.0f} s with work pending (step_timeout_s), killed"

    def _end_child(self, reason: str | None) -> None:
        """The child is gone: every request it held ends (with an error after a fault)."""
        with self._send_lock:
            conn, self._conn = self._conn, None
        conn.close()
        with self._lock:
            self.restarting = True
            self._serving.clear()
        self._end_requests(reason)
        self._broken = None

    def _end_requests(self, reason: str | None) -> None:
        """Every request the child holds ends (with an error naming `reason` after a fault)."""
        with self._lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
            grammars, self._grammars = self._grammars, {}
        if reason is None:
            error, finish = None, FinishReason.ABORT.value
        else:
            pid = self._process.pid
            log.error("%s: the engine process (pid %d) failed: %s; ending its %d requests with an error",
                      self.name, pid, reason, len(streams))
            error, finish = f"{ENGINE_FAULT} (pid {pid}: {reason}); retry", FinishReason.ERROR.value
            self.fault_failed_requests += len(streams)
        for call_id, call in calls.items():
            call.answer = ("RuntimeError", error or "the engine is shutting down", False)
            call.done.set()
        for future in grammars.values():
            future.set_result(None)
        for request_id, (stream, callback) in streams.items():
            self._delivery.post(callback, stream.end(request_id, finish, error))

    def _may_restart(self) -> bool:
        """Within the restart budget: take one; else the replica fails for good."""
        budget = self._restart_budget
        if not budget.take(time.monotonic()):
            return self._give_up(f"the engine process failed {budget.recent + 1} times within "
                                 f"{budget.window_s:g} s (engine_restarts={budget.max_restarts})")
        return True
