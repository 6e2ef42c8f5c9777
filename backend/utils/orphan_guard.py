"""Ends a Python-backend stub whose tritonserver is gone.

Triton's stub checks its parent too, but then finalizes the model, which waits for the model's
threads, and a model thread blocked on a call to the dead server (a response, a metric) never
returns: such stubs were seen living on as orphans, holding memory and cores, after the server
was killed. This thread only compares the parent pid, so nothing can hold it up.
"""

from __future__ import annotations

import os
import threading

POLL_S = 0.1


def exit_with_parent() -> threading.Thread:
    """Start a daemon thread that ends this process (exit code 1) once its parent changes."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(POLL_S)
        os._exit(1)  # no finalize: no response can reach a client any more

    thread = threading.Thread(target=watch, name="splitfuse-orphan-guard", daemon=True)
    thread.start()
    return thread
