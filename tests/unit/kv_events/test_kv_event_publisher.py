"""The publisher's socket and queue: vLLM's multipart frames (topic, 8-byte big-endian sequence
number, msgpack payload); a full queue drops the oldest batch, counts it and leaves a gap in the
sequence numbers; a taken endpoint fails loudly; close sends what is queued."""

from __future__ import annotations

import threading

import pytest
from kv_subscriber import Subscriber

from splitfuse.kv_events import publisher as publisher_module
from splitfuse.kv_events.events import AllBlocksCleared, BlockRemoved
from splitfuse.kv_events.publisher import KvEventPublisher


def _removed(n: int) -> list:
    return [BlockRemoved([n])]


def test_frames_topic_sequence_and_payload(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    publisher = KvEventPublisher(endpoint, topic="kv@r1", replica=1)
    assert publisher.endpoint == f"{endpoint}-1"
    with Subscriber(publisher.endpoint, b"kv@") as sub:
        sub.join(lambda: publisher.publish([AllBlocksCleared()]))
        for n in range(3):
            publisher.publish(_removed(n))
        messages = [sub.receive() for _ in range(3)]
        publisher.close()
    assert {m.topic for m in messages} == {b"kv@r1"}
    seqs = [m.seq for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + 3))  # consecutive, as queued
    assert [m.events for m in messages] == [[["BlockRemoved", [n], "GPU"]] for n in range(3)]
    assert {m.rank for m in messages} == {1}
    assert publisher.publish(_removed(9)) == 0  # closed: ignored


def test_full_queue_drops_the_oldest_and_counts_it(tmp_path, monkeypatch):
    sending = threading.Event()
    release = threading.Event()
    encode = publisher_module.encode_batch

    def slow_encode(batch, encoding):  # the thread holds the first real batch until released
        if batch.events and isinstance(batch.events[0], BlockRemoved) and batch.events[0].block_hashes == [0]:
            sending.set()
            release.wait(10)
        return encode(batch, encoding)

    monkeypatch.setattr(publisher_module, "encode_batch", slow_encode)
    publisher = KvEventPublisher(f"ipc://{tmp_path}/kv", max_queue=2)
    with Subscriber(publisher.endpoint) as sub:
        sub.join(lambda: publisher.publish([AllBlocksCleared()]))
        first = publisher.counts.batches_queued
        publisher.publish(_removed(0))
        assert sending.wait(10)
        dropped = [publisher.publish(_removed(n)) for n in range(1, 5)]  # 1, 2 queued; 3, 4 push them out
        assert dropped == [0, 0, 1, 1] and publisher.counts.batches_dropped == 2
        release.set()
        messages = [sub.receive() for _ in range(3)]
        publisher.close()
    assert [m.events[0][1] for m in messages] == [[0], [3], [4]]
    assert [m.seq - first for m in messages] == [0, 3, 4]  # the dropped batches' numbers are a gap


def test_taken_endpoint_fails_naming_the_parameter(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{_free_port()}")
    try:
        with pytest.raises(ValueError, match="kv_events_endpoint: cannot bind"):
            KvEventPublisher(publisher.endpoint)
    finally:
        publisher.close()
    KvEventPublisher(endpoint).close()


def test_close_sends_what_is_queued(tmp_path):
    publisher = KvEventPublisher(f"ipc://{tmp_path}/kv")
    with Subscriber(publisher.endpoint) as sub:
        sub.join(lambda: publisher.publish([AllBlocksCleared()]))
        for n in range(50):
            publisher.publish(_removed(n))
        publisher.close()
        messages = sub.until_quiet()
    assert [m.events[0][1][0] for m in messages] == list(range(50))
    assert publisher.counts.batches_sent == publisher.counts.batches_queued


def _free_port() -> int:
    from splitfuse.utils.ports import free_port

    return free_port()
