"""The `llm` model with faults injected by request id, for the serving tests.

conftest.fault_server renders a repository whose llm/1/model.py is this file; it subclasses the
real model, splitfuse.triton_server.llm_model (for test_hardening.py, and test_cancel.py's two
slowed replicas). The engine's faults are engine_faults.py's, applied where the engine runs.
A client request id starting with
    fault-add     makes adding the request to the engine raise,
    fault-abort   makes aborting it raise (stop it with a `stop` request),
    fault-sample  makes sampling any batch that holds it raise,
    fault-break   breaks the engine's block pool from then on (freeing KV raises),
    fault-respond makes building its second response raise,
    fault-slow    adds 20 ms to each step that samples it (the tiny model is fast enough to
                  finish a long generation before a test's next request arrives),
    fault-alloc   makes the engine process allocate until its memory limit stops it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from splitfuse.engine.core_process import ENGINE_TEST_HOOK
from splitfuse.triton_server import llm_model as _real


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
        # The engine process (engine_process) calls engine_faults.install with its EngineLoop.
        os.environ[ENGINE_TEST_HOOK] = f"{Path(__file__).with_name('engine_faults.py')}:install"
        super().initialize(args)
        if self.remote is None:  # engine_process=false: the engine is in this process
            _faults().install(self.loop)


def _faults():
    """engine_faults.py beside this file (conftest.fault_server copies both)."""
    spec = importlib.util.spec_from_file_location("engine_faults", Path(__file__).with_name("engine_faults.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
