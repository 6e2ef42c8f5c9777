"""What a replica whose engine failed for good does (its restart budget spent, or an engine that
cannot serve any more): while another replica of the model serves, it retires and the model stays
ready; the last replica standing unloads the model, so that it reports not ready.

Triton 2.51 keeps a loaded Python model READY whatever its stub does (even after the stub process
dies), and it cannot unload one instance of a model: unloading (explicit model control, the
launcher's default) takes every instance. So a retired replica stays loaded, takes no requests
the balance can steer away (it posts NOT_TAKING), refuses with UNAVAILABLE and a message clients
and the OpenAI front retry on (errors.REPLICA_RETIRED) what Triton still hands it, and then holds
its execute() a while, so that Triton gives the next requests to the replicas that serve.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from splitfuse.errors import REPLICA_RETIRED

RETIRED_HOLD_S = 5.0
"""How long a retired replica's execute() holds on after refusing requests (Triton gives the
next ones to the others meanwhile); it also bounds how long an unload waits for it."""
_POLL_S = 0.1


class ReplicaFailure:
    def __init__(self, model_name: str, instance: str, live_peers: Callable[[], bool],
                 unload_model: Callable[[str], None], log_error: Callable[[str], None]) -> None:
        self.model_name = model_name
        self.instance = instance
        self.live_peers = live_peers
        """Whether another replica of the model is alive and takes requests."""
        self.unload_model = unload_model
        self.log_error = log_error
        self.failure: str | None = None
        self.retired = False
        self.unloading = False

    def failed(self, failure: str) -> None:
        """The engine failed for good (once): retire while a peer serves, else unload the model."""
        self.failure = failure
        if self.live_peers():
            self.retired = True
            self.log_error(f"{self.instance}: the engine failed and serves no more requests ({failure}); this "
                           f"replica retires, '{self.model_name}' stays ready while its other replicas serve")
        else:
            self._unload()

    def tick(self) -> None:
        """Housekeeping: a retired replica whose last serving peer is gone unloads the model."""
        if self.retired and not self.unloading and not self.live_peers():
            self._unload()

    @property
    def refusing(self) -> bool:
        """Retired and still loaded: what Triton hands it is refused (`refusal`), then `hold`."""
        return self.retired and not self.unloading

    def refusal(self) -> str:
        return f"{REPLICA_RETIRED}: its engine failed ({self.failure}); the model's other replicas serve: retry"

    def hold(self, draining: Callable[[], bool]) -> None:
        """Keep execute() busy up to RETIRED_HOLD_S (not while the server drains or the model unloads)."""
        deadline = time.monotonic() + RETIRED_HOLD_S
        while time.monotonic() < deadline and not self.unloading and not draining():
            time.sleep(_POLL_S)

    def _unload(self) -> None:
        """On its own thread: unloading waits for finalize(), which joins the housekeeping thread."""
        self.unloading = True
        self.log_error(f"{self.instance}: the engine failed and serves no more requests ({self.failure}); "
                       f"unloading '{self.model_name}' so that it reports not ready")

        def unload() -> None:
            try:
                self.unload_model(self.model_name)
            except Exception as e:  # e.g. not in explicit model-control mode
                self.log_error(f"{self.instance}: could not unload '{self.model_name}' ({e}); it keeps reporting "
                               "ready, every request gets an UNAVAILABLE error: watch splitfuse_engine_healthy")

        threading.Thread(target=unload, name="splitfuse-unload", daemon=True).start()
