"""Guides compile in a child process (splitfuse.structured.compile_worker): it compiles what the
engine's process would, and a guide that crashes it, outlasts the time bound or exhausts its memory
costs only its own request; the child dies with its parent."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from transformers import AutoTokenizer  # noqa: E402

import splitfuse.utils.children  # noqa: E402
from splitfuse.structured.compile_worker import MEMORY_LIMIT_BYTES, CompileWorker, compile_guide  # noqa: E402
from splitfuse.structured.grammars import GrammarCache  # noqa: E402
from splitfuse.structured.guide import Guide  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def info(tokenizer):
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))


@pytest.fixture
def worker(info):
    """A worker with a short time bound and the test-only kinds `_sleep` and `_alloc`."""
    w = CompileWorker(info, timeout_s=2.0, _test_seams=True)
    yield w
    w.close()


@pytest.fixture
def patient_worker(info):
    """A worker whose time bound no loaded CI machine reaches: for the tests about a crash, which
    must be seen as a crash however long the killed child takes to close its end."""
    w = CompileWorker(info, timeout_s=120.0, _test_seams=True)
    yield w
    w.close()


@pytest.fixture(scope="module")
def shared_worker(info):
    """One worker for the tests that do not break it (a child takes ~1.5 s to start)."""
    w = CompileWorker(info)
    yield w
    w.close()


def _masks(grammar, tokens: list[int], vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask before each of `tokens` and after the last."""
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    rows = []
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask, 0)
        rows.append(bitmask.clone())
        assert matcher.accept_token(token)
    matcher.fill_next_token_bitmask(bitmask, 0)
    rows.append(bitmask.clone())
    return torch.cat(rows)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    """Whether any thread of `pid` still runs. A killed process's main thread turns zombie before
    its other threads have exited: until they have, its parent cannot collect it and its sockets
    stay open (the compiler child runs several threads)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


@pytest.mark.parametrize("kind,text,output", [
    ("json_schema", json.dumps(SCHEMA), '{"name": "ab c", "age": 42}'),
    ("regex", "[a-z]{3}-[0-9]{2}", "abc-12"),
    ("ebnf_grammar", 'root ::= "yes" | "no" | "maybe " [0-9]', "maybe 7"),
])
def test_the_child_compiles_what_this_process_would(shared_worker, info, tokenizer, kind, text, output):
    here = compile_guide(xgrammar.GrammarCompiler(info), kind, text)
    there = shared_worker.submit(kind, text).result()
    tokens = tokenizer.encode(output, add_special_tokens=False)
    expected = _masks(here, tokens, info.vocab_size)
    assert torch.equal(_masks(there, tokens, info.vocab_size), expected)
    assert 0 < int(sum(bin(w & 0xFFFFFFFF).count("1") for w in expected[0].tolist())) < info.vocab_size
    assert shared_worker.pid is not None  # it came from a child


def test_a_crash_fails_its_own_guide_and_the_next_compile_starts_a_new_child(patient_worker):
    worker = patient_worker
    worker.submit("regex", "[a-z]+").result()
    first = worker.pid
    compiling = worker.submit("_sleep", "600")
    _wait_for(lambda: worker.requests == 2)
    os.kill(first, signal.SIGSEGV)  # what a compiler bug would do
    with pytest.raises(ValueError, match=r"the grammar compiler failed on this guide \(exit -11, SIGSEGV\)"):
        compiling.result(timeout=150)
    assert worker.submit("regex", "[0-9]+").result(timeout=120) is not None
    assert worker.pid not in (None, first)


def test_a_child_killed_while_idle_is_replaced_without_failing_a_guide(worker):
    worker.submit("regex", "[a-z]+").result()
    first = worker.pid
    os.kill(first, signal.SIGKILL)  # the OOM killer, an operator
    _wait_for(lambda: not _alive(first))
    assert worker.submit("regex", "[0-9]+").result(timeout=120) is not None
    assert worker.pid not in (None, first)


def test_a_child_found_dead_only_when_the_guide_is_sent_is_replaced_without_failing_it(worker, monkeypatch):
    """The race of the test above: the child dies while idle but its death is not seen before the
    guide goes out (here: its exit not yet collected). Writing to it fails: nothing of the guide
    reached it, so the guide goes to a new child instead of being held against it."""
    worker.submit("regex", "[a-z]+").result()
    first = worker.pid
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: not _alive(first))
    monkeypatch.setattr(worker._child.process, "poll", lambda: None)  # its exit not yet collected
    assert worker.submit("regex", "[0-9]+").result(timeout=120) is not None
    assert worker.pid not in (None, first)


def test_a_guide_past_the_time_bound_is_refused_and_its_child_killed(worker):
    worker.submit("regex", "[a-z]+").result()
    first = worker.pid
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"\(_sleep\) took longer than guide_compile_timeout_s \(2 s\) to compile"):
        worker.submit("_sleep", "60").result()
    assert time.monotonic() - start < 30
    assert not _alive(first)
    assert worker.submit("regex", "[0-9]+").result(timeout=120) is not None
    assert worker.pid not in (None, first)


def test_a_guide_past_the_memory_bound_is_refused(worker):
    with pytest.raises(ValueError, match=r"ran out of memory on this guide \(limit 4 GiB\)"):
        worker.submit("_alloc", str(2 * MEMORY_LIMIT_BYTES)).result()
    assert worker.submit("_alloc", str(64 << 20)).result(timeout=120) is not None  # a new child, under the limit


def test_one_guide_asked_for_at_once_compiles_once(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer))
    cache._worker = worker = CompileWorker(cache._info, _test_seams=True)
    try:
        busy = worker.submit("_sleep", "2")  # the requests below queue behind it, all at once
        guide = Guide("regex", "[a-z]{2}[0-9]")
        results: list = []
        late: list[bool] = []

        def ask() -> None:
            late.append(busy.done())
            results.append(cache.compile(guide))

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert late == [False] * 6  # each asked before the guide could have compiled
        assert len(results) == 6 and all(r is results[0] for r in results)
        assert worker.requests == 2  # the sleep and one compile
        pid = worker.pid
    finally:
        cache.close()
    assert not _alive(pid)


def test_without_a_child_guides_compile_in_process_after_a_warning(tokenizer, monkeypatch, caplog):
    def no_python() -> str:
        raise RuntimeError("no Python interpreter found")

    monkeypatch.setattr(splitfuse.utils.children, "python_executable", no_python)
    cache = GrammarCache(tokenizer, len(tokenizer))
    try:
        with caplog.at_level(logging.WARNING, logger="splitfuse.structured.compile_worker"):
            assert cache.compile(Guide("regex", "[a-z]+")) is not None
            assert cache.compile(Guide("regex", "[0-9]+")) is not None
        assert len([r for r in caplog.records if "compile in this process" in r.getMessage()]) == 1  # once
        assert cache._worker.pid is None
        with pytest.raises(ValueError, match="does not compile"):
            cache.compile(Guide("regex", "([a-z"))
    finally:
        cache.close()


PARENT = """
import sys, time
from transformers import AutoTokenizer
from splitfuse.structured.compile_worker import CompileWorker
from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.guide import Guide
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
cache = GrammarCache(tokenizer, len(tokenizer))
cache._worker = CompileWorker(cache._info, _test_seams=True)
cache.compile(Guide("json"))
cache._worker.submit("_sleep", "300")  # busy, not reading: only the kernel's death signal ends it
while cache._worker.requests < 2:
    time.sleep(0.01)
print(cache._worker.pid, flush=True)
time.sleep(300)
"""


def test_the_child_dies_with_its_parent(tiny_llama):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tiny_llama], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # SIGKILL: nothing in the parent gets to stop its child
        parent.wait(30)
        _wait_for(lambda: not _alive(child), timeout_s=5)
    finally:
        parent.kill()
        parent.wait(30)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
