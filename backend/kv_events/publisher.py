"""The ZeroMQ PUB socket a replica's KV events go out on, as vLLM's publisher sends them: each batch
a multipart message (topic, sequence number as 8 bytes big-endian, msgpack payload).

The engine never waits on it: `publish` puts a step's batch on a bounded queue and returns; a
thread of its own encodes and sends. When the queue is full the oldest batch is dropped (and
counted). A batch's sequence number is given as it is queued, so a subscriber sees a dropped
batch as a gap in the numbers (as it sees messages its own slowness made the PUB socket drop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from splitfuse.kv_events.endpoint import replica_endpoint
from splitfuse.kv_events.events import EventBatch, KvEvent, encode_batch

log = logging.getLogger(__name__)

SEND_HWM = 100_000
"""Messages the PUB socket holds per subscriber before it drops some for that subscriber."""
CLOSE_TIMEOUT_S = 1.0
"""How long `close` lets the thread send what is queued."""


@dataclass
class PublisherCounts:
    """Totals since the publisher started."""

    batches_queued: int = 0
    batches_sent: int = 0
    batches_dropped: int = 0
    """Dropped unsent: the queue was full (the subscribers' side is not seen here)."""


class KvEventPublisher:
    """A PUB socket bound to `endpoint` (moved for `replica`, endpoint.py), fed by `publish`."""

    def __init__(self, endpoint: str, topic: str = "", max_queue: int = 1000, replica: int = 0,
                 encoding: str = "array") -> None:
        if max_queue < 1:
            raise ValueError(f"kv_events_max_queue must be >= 1, got {max_queue}")
        self.endpoint = replica_endpoint(endpoint, replica)
        self.replica = replica
        self.counts = PublisherCounts()
        self._topic = topic.encode("utf-8")
        self._encoding = encoding
        self._queue: deque[tuple[int, EventBatch]] = deque()
        self._max_queue = max_queue
        self._next_seq = 0
        self._closing = False
        self._wake = threading.Condition()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="splitfuse-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"kv_events_endpoint: cannot bind {self.endpoint}: {self._error}") from self._error
        log.info("splitfuse: KV events published on %s (topic %r)", self.endpoint, topic)

    def publish(self, events: list[KvEvent]) -> int:
        """Queue one step's events; returns the batches dropped to make room (0 or 1). Never waits
        on the socket."""
        if not events:
            return 0
        batch = EventBatch(time.time(), events, self.replica)
        dropped = 0
        with self._wake:
            if self._closing:
                return 0
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                dropped = 1
                self.counts.batches_dropped += 1
            self._queue.append((self._next_seq, batch))
            self._next_seq += 1
            self.counts.batches_queued += 1
            self._wake.notify()
        return dropped

    def close(self) -> None:
        """Send what is queued (for up to CLOSE_TIMEOUT_S), then close the socket."""
        with self._wake:
            if self._closing:
                return
            self._closing = True
            self._wake.notify()
        self._thread.join(CLOSE_TIMEOUT_S + 1.0)

    # ---- the publisher's thread --------------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        try:
            socket.setsockopt(zmq.SNDHWM, SEND_HWM)
            socket.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._error = e
            socket.close(linger=0)
            context.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._send_loop(socket)
        finally:
            socket.close(linger=int(CLOSE_TIMEOUT_S * 1000))
            context.term()

    def _send_loop(self, socket: zmq.Socket) -> None:
        deadline = None
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing and deadline is None:
                    deadline = time.monotonic() + CLOSE_TIMEOUT_S
                if not self._queue or (deadline is not None and time.monotonic() > deadline):
                    return
                seq, batch = self._queue.popleft()
            try:
                payload = encode_batch(batch, self._encoding)
                socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                self.counts.batches_sent += 1
            except Exception:  # one batch that cannot go out must not end the events of the replica
                log.exception("splitfuse: KV event batch %d could not be sent", seq)
