"""A test's subscriber to a KV event publisher: a SUB socket, the handshake that makes sure it
hears what follows (ZeroMQ drops what a PUB sends before a subscriber is connected), and the
messages decoded with plain msgpack."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import zmq


@dataclass
class Message:
    topic: bytes
    seq: int
    ts: float
    events: list
    rank: int | None


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)

    def receive(self, timeout_s: float = 5.0) -> Message | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.socket.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        return Message(topic, int.from_bytes(seq, "big"), ts, events, rank)

    def until_quiet(self, quiet_s: float = 0.5) -> list[Message]:
        """Every message until none came for `quiet_s`."""
        messages = []
        while (message := self.receive(quiet_s)) is not None:
            messages.append(message)
        return messages

    def join(self, publish_probe, timeout_s: float = 10.0) -> None:
        """Send probes through `publish_probe()` until one arrives, then drop what arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            publish_probe()
            if self.receive(0.05) is not None:
                self.until_quiet(0.2)
                return
        raise AssertionError("the subscriber never heard the publisher")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
