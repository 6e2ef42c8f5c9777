"""The `llm` model with faults injected by request id, for the serving tests.

conftest.fault_server renders a repository whose llm/1/model.py is this file; it subclasses the
real model, splitfuse.triton_server.llm_model (for test_hardening.py, and test_cancel.py's two
slowed replicas).
A client request id starting with
    fault-add     makes adding the request to the engine raise,
    fault-abort   makes aborting it raise (stop it with a `stop` request),
    fault-sample  makes sampling any batch that holds it raise,
    fault-break   breaks the engine's block pool from then on (freeing KV raises),
    fault-respond makes building its second response raise,
    fault-slow    adds 20 ms to each step that samples it (the tiny model is fast enough to
                  finish a long generation before a test's next request arrives).
"""

from __future__ import annotations

import time

from splitfuse.triton_server import llm_model as _real


SLOW_STEP_S = 0.02


class InjectedFault(RuntimeError):
    pass


_built: dict[str, int] = {}
_response_arrays = _real.response_arrays


def _faulty_response_arrays(parsed, out, echo_prompt=None, stop_handle=None):
    if _marked(out.request_id, "respond"):
        _built[out.request_id] = _built.get(out.request_id, 0) + 1
        if _built[out.request_id] == 2:
            raise InjectedFault("injected response fault")
    return _response_arrays(parsed, out, echo_prompt, stop_handle)


_real.response_arrays = _faulty_response_arrays


def _marked(engine_id: str, kind: str) -> bool:
    return engine_id.startswith(f"fault-{kind}")  # engine ids are "<client id>#<n>"


class TritonPythonModel(_real.TritonPythonModel):
    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        engine = self.engine
        add, abort, sample = engine.add_prepared, engine.abort_request, engine.sampler

        def add_prepared(request_id, token_ids, params, **kwargs):
            if _marked(request_id, "add"):
                raise InjectedFault(f"injected add fault for {request_id}")
            if _marked(request_id, "break"):
                engine.blocks.free = _broken_free
            return add(request_id, token_ids, params, **kwargs)

        def abort_request(request_id):
            if _marked(request_id, "abort"):
                raise InjectedFault(f"injected abort fault for {request_id}")
            return abort(request_id)

        def sampler(logits, seqs):
            if any(_marked(s.request_id, "sample") for s in seqs):
                raise InjectedFault("injected sampling fault")
            if any(_marked(s.request_id, "slow") for s in seqs):
                time.sleep(SLOW_STEP_S)
            return sample(logits, seqs)

        engine.add_prepared, engine.abort_request, engine.sampler = add_prepared, abort_request, sampler


def _broken_free(seq) -> None:
    raise InjectedFault("injected block pool fault")
