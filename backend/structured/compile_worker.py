"""Compiling guides in a child process, bounded in time and memory.

Clients write the guides (a schema, expression or grammar) and xgrammar's compiler is native
code: a guide that crashes it, makes it loop or eats memory would take the replica down with
it (inside Triton's Python stub, that aborts the whole server). So one persistent child process
compiles, answering each (kind, text) with the grammar serialized; the parent deserializes it for
its own copy of the tokenizer info. The child gets SIGKILL when its parent dies, caps its address
space (MEMORY_LIMIT_BYTES), and is killed when a compile takes longer than its timeout (GrammarLimits.compile_timeout_s); a
failed guide becomes a ValueError for its request, and the next compile starts a new child.

One thread of the parent owns the child and compiles one guide at a time: the kernel sends the
death signal when the *thread* that started a child ends, and request threads come and go.
Only where no child can be started at all (no Python interpreter to run, no fork) does that
thread compile in-process, unprotected, after a warning.

    python -m splitfuse.structured.compile_worker FD MEMORY_LIMIT_BYTES [--test-seams]
"""

from __future__ import annotations

import json
import logging
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from splitfuse.config import GrammarLimits
from splitfuse.structured.guide import Guide
from splitfuse.structured.schema_keywords import check_schema_keywords
from splitfuse.utils import children

log = logging.getLogger(__name__)

MEMORY_LIMIT_BYTES = 4 << 30
"""The child's address space; it peaks near 1.2 GiB compiling the 49k-token built-in JSON grammar."""
START_TIMEOUT_S = 120.0
COMPILER_NICENESS = 10
"""For the child to import xgrammar (with torch, ~1.5 s) and load the tokenizer info."""
_EXIT_WAIT_S = 5.0

# Replies from the child: one tag byte, then the payload.
_HELLO, _READY, _GRAMMAR, _ERROR, _OUT_OF_MEMORY = b"H", b"R", b"G", b"E", b"M"


class CompilerUnavailable(ValueError):
    """The compiler process could not be restarted: the guide was never tried (the request
    fails, and the guide is not to be held against it)."""


class _WorkerUnavailable(Exception):
    """No child could be started (as opposed to one that died on a guide)."""


def compile_guide(compiler: Any, kind: str, text: str) -> Any:
    """Compile one guide with an xgrammar GrammarCompiler; ValueError naming the problem."""
    try:
        if kind == "json":
            return compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            try:
                schema = json.loads(text)  # a clear message for JSON that is not even JSON
            except json.JSONDecodeError as e:
                raise ValueError(f"guided_decoding_guide (json_schema) is not valid JSON: {e}") from None
            check_schema_keywords(schema)
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf_grammar":
            return compiler.compile_grammar(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(option) for option in Guide(kind, text).choices())
            return compiler.compile_grammar(f"root ::= {alternatives}")
        raise ValueError(f"guided_decoding_guide_type {kind!r} is not a kind this compiler knows")
    except (ValueError, MemoryError):
        raise
    except Exception as e:  # xgrammar reports a bad schema, expression or grammar its own ways
        raise ValueError(f"guided_decoding_guide ({kind}) does not compile: "
                         f"{type(e).__name__}: {str(e)[:500]}") from None


class CompileWorker:
    """Compiles guides for one tokenizer in a child process; `submit` is thread-safe."""

    def __init__(self, tokenizer_info: Any, timeout_s: float = GrammarLimits.compile_timeout_s,
                 memory_limit: int = MEMORY_LIMIT_BYTES, *, _test_seams: bool = False) -> None:
        """`_test_seams` (tests only) makes the child also take the kinds `_sleep` (seconds) and
        `_alloc` (bytes), to stand for a guide that hangs or eats memory."""
        self._child = _Child(tokenizer_info, timeout_s, memory_limit, _test_seams)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # The thread holds the queue and the child, not this handle: dropping the handle stops both.
        self._stop = weakref.finalize(self, self._queue.put, None)

    def submit(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar (xgrammar CompiledGrammar) or of a ValueError."""
        future: Future = Future()
        with self._lock:
            if not self._stop.alive:
                raise RuntimeError("the grammar compile worker is closed")
            if self._thread is None:  # started at the first compile, as the child is
                self._thread = threading.Thread(target=_serve_queue, args=(self._queue, self._child),
                                                name="splitfuse-grammar-compiler", daemon=True)
                self._thread.start()
            self._queue.put((kind, text, future))
        return future

    @property
    def pid(self) -> int | None:
        """The child's process id, None while there is none."""
        process = self._child.process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def requests(self) -> int:
        """Guides sent to children so far."""
        return self._child.requests

    def close(self) -> None:
        """Stop the child (after the compiles already asked for)."""
        with self._lock:
            self._stop()
            thread = self._thread
        if thread is not None:
            thread.join(_EXIT_WAIT_S)


def _serve_queue(requests: queue.SimpleQueue, child: _Child) -> None:
    while True:
        item = requests.get()
        if item is None:
            child.stop()
            return
        kind, text, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(child.compile(kind, text))
        except BaseException as e:  # every failure belongs to the request that asked
            future.set_exception(e if isinstance(e, ValueError) else
                                 ValueError(f"the grammar compiler failed: {type(e).__name__}: {e}"))


class _Child:
    """The child process and its connection; used by the compiling thread only."""

    def __init__(self, info: Any, timeout_s: float, memory_limit: int, test_seams: bool) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.info = info
        self.timeout_s = timeout_s
        self.memory_limit = memory_limit
        self.test_seams = test_seams
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.requests = 0
        self._started_once = False
        self._info_json: bytes | None = None
        self._in_process: Any = None  # the fallback compiler where no child can start

    def compile(self, kind: str, text: str) -> Any:
        if self._in_process is None and (self.process is None or self.process.poll() is not None):
            self._restart()  # the first, or one that died while idle
        if self._in_process is not None:
            return compile_guide(self._in_process, kind, text)
        payload = json.dumps([kind, text]).encode()
        self.requests += 1
        try:
            try:
                self.conn.send_bytes(payload)
            except OSError:  # its end was closed before this guide came: it died while idle
                self._reap()
                self._restart()
                if self._in_process is not None:
                    return compile_guide(self._in_process, kind, text)
                self.conn.send_bytes(payload)
            answered = self.conn.poll(self.timeout_s)
            reply = self.conn.recv_bytes() if answered else None
        except (EOFError, OSError):  # it died with this guide in hand
            code = self._reap()
            log.warning("splitfuse: the grammar compiler process died on a %s guide (%s)", kind, code)
            raise ValueError(f"the grammar compiler failed on this guide ({code})") from None
        if reply is None:
            self.stop()
            log.warning("splitfuse: killed the grammar compiler process: a %s guide took over %g s", kind,
                        self.timeout_s)
            raise ValueError(f"guided_decoding_guide ({kind}) took longer than guide_compile_timeout_s "
                             f"({self.timeout_s:g} s) to compile")
        tag, body = reply[:1], reply[1:]
        if tag == _GRAMMAR:
            try:
                return self._xgr.CompiledGrammar.deserialize_json(body.decode(), self.info)
            except Exception as e:
                raise ValueError(f"the grammar compiler's answer could not be read: {str(e)[:200]}") from None
        if tag == _OUT_OF_MEMORY:
            self._reap()  # it exits: after a failed allocation its state is not to be trusted
            raise ValueError(f"the grammar compiler ran out of memory on this guide (limit "
                             f"{self.memory_limit / (1 << 30):g} GiB)")
        if tag == _ERROR:
            raise ValueError(body.decode(errors="replace")[:1000])
        raise ValueError("the grammar compiler answered nonsense")

    def _restart(self) -> None:
        """A new child (closing what is left of the last one); where none can ever start, the
        in-process compiler, after one warning."""
        self.stop()
        try:
            self._start()
        except _WorkerUnavailable as e:
            if self._started_once:
                raise CompilerUnavailable(f"the grammar compiler process could not be restarted: {e}") from None
            log.warning("splitfuse: guides compile in this process, without time or memory bounds: "
                        "no compiler process could start (%s)", e)
            self._in_process = self._xgr.GrammarCompiler(self.info, max_threads=1)

    def _start(self) -> None:
        if self._info_json is None:
            self._info_json = self.info.serialize_json().encode()
        ours, theirs = Pipe()
        try:
            # A fresh interpreter, not multiprocessing: inside Triton's stub sys.executable is the
            # stub, and a spawned child would re-run the parent's __main__.
            command = [children.python_executable(), "-m", __name__, str(theirs.fileno()), str(self.memory_limit)]
            if self.test_seams:
                command.append("--test-seams")
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            preexec_fn=children.die_with_parent())
        except (OSError, RuntimeError) as e:
            ours.close()
            raise _WorkerUnavailable(f"{type(e).__name__}: {e}") from None
        finally:
            theirs.close()
        self.conn = ours
        try:
            self._expect(_HELLO, START_TIMEOUT_S)
            ours.send_bytes(self._info_json)
            self._expect(_READY, START_TIMEOUT_S)
        except (EOFError, OSError, TimeoutError) as e:
            detail = str(e) if isinstance(e, TimeoutError) else self._reap()
            self.stop()
            raise _WorkerUnavailable(f"the compiler process did not start ({detail})") from None
        self._started_once = True

    def _expect(self, tag: bytes, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        if self.conn.recv_bytes() != tag:
            raise OSError("unexpected answer")

    def _reap(self) -> str:
        """Wait for the child that closed its end; describe how it ended."""
        process = self.process
        if process is None:
            return "no process"
        try:
            process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self.stop()
        code = process.returncode
        if code is not None and code < 0:
            try:
                return f"exit {code}, {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exit {code}"

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            try:
                self.process.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("splitfuse: the grammar compiler process %d did not exit after SIGKILL", self.process.pid)


# ---- the child ------------------------------------------------------------------------------
def _serve(conn: Connection, memory_limit: int, test_seams: bool) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash should not write a GiB of core file
    import xgrammar

    conn.send_bytes(_HELLO)
    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    # The parent caches by guide text; xgrammar's own cache would only grow toward the limit here.
    # One thread at a lower priority: the engine's threads own the cores; xgrammar's default of
    # eight threads made a 0.3 s compile take 12 s and slowed the engine's steps eightfold on two
    # busy cores (perf/served/structured_bench.py).
    os.nice(COMPILER_NICENESS)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    conn.send_bytes(_READY)
    while True:
        try:
            kind, text = json.loads(conn.recv_bytes())
        except EOFError:  # the parent closed: done
            return 0
        try:
            if test_seams and kind in _TEST_SEAMS:
                _TEST_SEAMS[kind](text)
                kind, text = "json", ""
            reply = _GRAMMAR + compile_guide(compiler, kind, text).serialize_json().encode()
        except MemoryError:
            conn.send_bytes(_OUT_OF_MEMORY)
            return 1
        except ValueError as e:
            reply = _ERROR + str(e).encode()
        conn.send_bytes(reply)


def _hog(text: str) -> None:
    held = bytearray(int(text))
    del held


_TEST_SEAMS = {"_sleep": lambda text: time.sleep(float(text)), "_alloc": _hog}


def main(argv: list[str]) -> int:
    fd, memory_limit = int(argv[0]), int(argv[1])
    return _serve(Connection(fd), memory_limit, "--test-seams" in argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
