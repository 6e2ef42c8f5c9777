"""The engine half of fault_model.py: faults injected by request id into an EngineLoop's engine.

With the engine in its own process (engine_process, the default) the engine process calls
`install` with its EngineLoop (the ENGINE_TEST_HOOK seam of splitfuse.engine.core_process);
in process, fault_model.py calls it. Request ids (engine ids are "<client id>#<n>") starting with
    fault-add     make adding the request to the engine raise,
    fault-abort   make aborting it raise,
    fault-sample  make sampling any batch that holds it raise,
    fault-break   break the engine's block pool from then on (freeing KV raises),
    fault-slow    add 20 ms to each step that samples it,
    fault-alloc   make the engine process allocate until its memory limit stops it (an abort,
                  as a C++ kernel whose allocation fails does).
STEP_SLEEP_ENV in the environment (seconds) slows every step that samples, so that a test's
generations are still running when it injects a process fault.
"""

from __future__ import annotations

import ctypes
import os
import time

SLOW_STEP_S = 0.02
STEP_SLEEP_ENV = "SPLITFUSE_TEST_STEP_SLEEP_S"


class InjectedFault(RuntimeError):
    pass


def marked(engine_id: str, kind: str) -> bool:
    return engine_id.startswith(f"fault-{kind}")


def install(loop) -> None:
    engine = loop.engine
    add, abort, sample = engine.add_prepared, engine.abort_request, engine.sampler
    every_step = float(os.environ.get(STEP_SLEEP_ENV, "0"))

    def add_prepared(request_id, token_ids, params, **kwargs):
        if marked(request_id, "add"):
            raise InjectedFault(f"injected add fault for {request_id}")
        if marked(request_id, "break"):
            engine.blocks.free = _broken_free
        if marked(request_id, "alloc"):
            _allocate_until_refused()
        return add(request_id, token_ids, params, **kwargs)

    def abort_request(request_id):
        if marked(request_id, "abort"):
            raise InjectedFault(f"injected abort fault for {request_id}")
        return abort(request_id)

    def sampler(logits, seqs):
        if any(marked(s.request_id, "sample") for s in seqs):
            raise InjectedFault("injected sampling fault")
        if any(marked(s.request_id, "slow") for s in seqs):
            time.sleep(SLOW_STEP_S)
        if every_step:
            time.sleep(every_step)
        return sample(logits, seqs)

    engine.add_prepared, engine.abort_request, engine.sampler = add_prepared, abort_request, sampler


def _broken_free(seq) -> None:
    raise InjectedFault("injected block pool fault")


def _allocate_until_refused() -> None:
    """Reserve 64 MiB blocks until malloc fails (RLIMIT_AS counts address space: nothing is
    touched, so the machine's memory is not used), then abort as native code does on a failed
    allocation."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    for _ in range(1 << 12):  # 256 GiB of address space at most
        if not libc.malloc(64 << 20):
            libc.abort()
    raise InjectedFault("no memory limit stopped the allocation")
