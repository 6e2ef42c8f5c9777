"""Handing each request's outputs to its callback on a few delivery threads.

A request has at most one delivery in flight: outputs produced meanwhile wait in its mailbox and
go out merged into one (their deltas joined) when the callback returns, so a slow consumer gets
fewer, larger outputs instead of a growing queue, and a request's outputs always arrive in
order, its final one last. Used by EngineLoop (in process) and by RemoteEngine (the stub's side
of an engine in its own process).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from splitfuse.engine.sequence import RequestOutput

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]

# Threads that call the output callbacks. A Triton response send is a round trip to the server
# process (~1 ms on 2 busy cores, mostly waiting); 16 threads did no better than 4 (the server
# process takes the responses one at a time).
DELIVERY_THREADS = 4


class _Mailbox:
    """One request's delivery state: its callback, whether a delivery is in flight, and the
    output produced since (merged)."""

    __slots__ = ("key", "callback", "busy", "pending")

    def __init__(self, key: tuple[str, int], callback: OutputCallback) -> None:
        self.key = key
        self.callback = callback
        self.busy = False
        self.pending: RequestOutput | None = None


class Delivery:
    """The mailboxes and the delivery threads (started at the first output)."""

    def __init__(self, on_callback_error: Callable[[str], None]) -> None:
        """`on_callback_error(request_id)`: a callback raised on an unfinished output (the
        request is to be aborted)."""
        self._on_callback_error = on_callback_error
        self._lock = threading.Lock()
        # Requests with a delivery in flight or waiting, by (request id, callback identity): a
        # request id reused while its predecessor's last outputs are still going out gets a box
        # of its own.
        self._mailboxes: dict[tuple[str, int], _Mailbox] = {}
        self._pool: ThreadPoolExecutor | None = None

    def post(self, callback: OutputCallback, out: RequestOutput) -> None:
        """Deliver `out` on a delivery thread, or merge it into the request's mailbox while an
        earlier output of the request is still being delivered."""
        key = (out.request_id, id(callback))
        with self._lock:
            box = self._mailboxes.get(key)
            if box is None:
                box = self._mailboxes[key] = _Mailbox(key, callback)
            if box.busy:
                box.pending = out if box.pending is None else out.after(box.pending)
                return
            box.busy = True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(DELIVERY_THREADS, thread_name_prefix="splitfuse-delivery")
        self._pool.submit(self._drain, box, out)

    def shutdown(self) -> None:
        """Wait for the deliveries already posted."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True)

    def _drain(self, box: _Mailbox, out: RequestOutput) -> None:
        """Delivery thread: call the callback with `out`, then with whatever arrived meanwhile."""
        while True:
            try:
                box.callback(out)
            except Exception:
                log.exception("output callback for %s failed; aborting it", out.request_id)
                if not out.finished:
                    self._on_callback_error(out.request_id)
            with self._lock:
                if box.pending is None:
                    box.busy = False
                    if out.finished:
                        self._mailboxes.pop(box.key, None)
                    return
                out, box.pending = box.pending, None
