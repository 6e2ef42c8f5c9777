"""The engine process of a served replica: an unchanged EngineLoop behind a pipe (issue 59).

The replica's Triton stub starts it (remote.py) and sends the configs as the first message; it
builds the engine, answers HELLO with the engine's facts, then takes submits and aborts from the
pipe (main thread) while one writer thread sends the outputs and step statistics in batches.
An engine fault here (a kernel's segfault, the OOM killer, a hang) costs this replica's requests
and a restart, not the server. The kernel kills this process when its stub ends (die_with_parent),
and it exits when the pipe closes.

    python -m splitfuse.engine.core_process FD

A test seam: ENGINE_TEST_HOOK in the environment, "FILE.py:FUNCTION", names a function this
process calls with its EngineLoop once the engine is built (tests/serving inject faults so).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine import wire
from splitfuse.engine.loop import EngineLoop
from splitfuse.engine.sequence import RequestOutput

log = logging.getLogger(__name__)

ENGINE_TEST_HOOK = "SPLITFUSE_ENGINE_TEST_HOOK"
BATCH_INTERVAL_S = 0.25
"""A batch goes at least this often (statistics, and the stub's sign that the engine lives)."""


class _Sender:
    """The pipe's sending end, shared by the main thread, the writer and guide callbacks."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


class _PipeLogHandler(logging.Handler):
    """The engine's log records (its start-up facts, warnings, errors) to the stub, which logs them
    where its own go (Triton's log): this process's stderr is not the server's log."""

    def __init__(self, sender: _Sender) -> None:
        super().__init__(logging.INFO)
        self.sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sender.send((wire.LOG, record.name, record.levelno, self.format(record)))
        except Exception:  # a log line must never break the engine (the pipe may be gone)
            self.handleError(record)


class _Outbox:
    """Outputs and step statistics waiting for the writer thread, which sends them in batches."""

    def __init__(self, sender: _Sender) -> None:
        self.sender = sender
        self.cond = threading.Condition()
        self.records: list[tuple] = []
        self.steps: list = []
        self.loop: EngineLoop | None = None
        self.failure_sent = False
        self.closing = False  # the loop has shut down: send what is left, then end

    def callback(self) -> Callable[[RequestOutput], None]:
        """A request's output callback (called on the loop's delivery threads, one at a time)."""
        first = True

        def on_output(out: RequestOutput) -> None:
            nonlocal first
            record = wire.to_record(out, first)
            first = False
            with self.cond:
                self.records.append(record)
                self.cond.notify()

        return on_output

    def step(self, stats) -> None:
        with self.cond:
            self.steps.append(stats)

    def run(self) -> None:
        """Writer thread: send what is waiting, at least every BATCH_INTERVAL_S."""
        lora = self.loop.engine.runner.lora is not None  # configured or loadable (lora_load_dir)
        while True:
            with self.cond:
                if not self.records and not self.closing:
                    self.cond.wait(BATCH_INTERVAL_S)
                records, self.records = self.records, []
                steps, self.steps = self.steps, []
                closing = self.closing
            failure = self.loop.failure  # set before the loop fails its requests: it goes first
            if failure is not None and not self.failure_sent:
                self.failure_sent = True
                self.sender.send((wire.FAILED, failure, self.loop.resources_lost))
            self.sender.send((wire.BATCH, self._progress(records, steps, lora)))
            if closing:
                return

    def close(self) -> None:
        """The loop shut down (its deliveries done): the writer sends the rest and ends."""
        with self.cond:
            self.closing = True
            self.cond.notify()

    def _progress(self, records: list[tuple], steps: list, lora: bool) -> wire.Progress:
        loop, engine = self.loop, self.loop.engine
        waiting = loop.num_waiting
        return wire.Progress(records=records, steps=steps, step_count=loop.steps, num_waiting=waiting,
                             busy=waiting > 0 or engine.has_unfinished_requests(), stats=engine.stats(),
                             lora_stats=engine.lora_stats() if lora else None)


def _submit(loop: EngineLoop, outbox: _Outbox, message: tuple) -> None:
    _, call_id, request_id, prompt, params = message
    try:
        grammar = loop.submit(request_id, prompt, params, outbox.callback())
    except Exception as e:
        outbox.sender.send((wire.REPLY, call_id, type(e).__name__, str(e), False))
        return
    outbox.sender.send((wire.REPLY, call_id, None, "", grammar is not None))
    if grammar is not None:
        grammar.add_done_callback(lambda _: outbox.sender.send((wire.GRAMMAR, request_id)))


def _lora(loop: EngineLoop, sender: _Sender, message: tuple) -> None:
    """A run-time LoRA load or unload, answered like a submit (its own thread: reading an
    adapter's files must not hold up the submits behind it)."""
    _, call_id, op, name, path = message
    try:
        if op == "load":
            loop.load_lora(name, path, timeout=wire.LORA_TIMEOUT_S)
        else:
            loop.unload_lora(name, timeout=wire.LORA_TIMEOUT_S)
    except Exception as e:
        sender.send((wire.REPLY, call_id, type(e).__name__, str(e), False))
        return
    sender.send((wire.REPLY, call_id, None, "", False))


def _serve(conn: Connection, loop: EngineLoop, outbox: _Outbox) -> None:
    """Main thread: the stub's commands, until it says stop or its end closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the stub is gone: nothing to answer
            os._exit(0)
        kind = message[0]
        if kind == wire.SUBMIT:
            _submit(loop, outbox, message)
        elif kind == wire.ABORT:
            loop.abort(message[1])
        elif kind == wire.LORA:
            threading.Thread(target=_lora, args=(loop, outbox.sender, message), name="splitfuse-lora",
                             daemon=True).start()
        elif kind == wire.SHUTDOWN:
            loop.shutdown(timeout=message[1])
            return


def _apply_test_hook(loop: EngineLoop) -> None:
    hook = os.environ.get(ENGINE_TEST_HOOK)
    if not hook:
        return
    path, _, function = hook.rpartition(":")
    spec = importlib.util.spec_from_file_location("splitfuse_engine_test_hook", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)(loop)


def _limit_memory(limit: int) -> None:
    """engine_memory_limit_bytes: this process's address space (an allocation past it fails)."""
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(fd: int) -> None:
    conn = Connection(fd)
    config, server, _name = conn.recv()
    config: EngineConfig
    server: ServerConfig
    _limit_memory(server.engine_memory_limit_bytes)
    sender = _Sender(conn)
    splitfuse_log = logging.getLogger("splitfuse")
    splitfuse_log.addHandler(_PipeLogHandler(sender))
    splitfuse_log.setLevel(logging.INFO)
    splitfuse_log.propagate = False  # not also to stderr (the stub logs them)
    outbox = _Outbox(sender)
    loop = EngineLoop(config, on_step=outbox.step, server=server)
    try:
        engine = loop.start()
        _apply_test_hook(loop)
    except BaseException as e:
        log.exception("building the engine failed")
        sender.send((wire.START_FAILED, f"{type(e).__name__}: {e}"))
        return
    outbox.loop = loop
    sender.send((wire.HELLO, wire.engine_facts(engine)))
    writer = threading.Thread(target=outbox.run, name="splitfuse-engine-writer", daemon=True)
    writer.start()
    _serve(conn, loop, outbox)
    outbox.close()  # the aborted requests' final outputs go out before the pipe closes
    writer.join()


if __name__ == "__main__":
    main(int(sys.argv[1]))
