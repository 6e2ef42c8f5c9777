"""The cost of the channel between the Triton stub and an engine in its own process (issue 59):
each engine step the stub learns every running sequence's new tokens, and now and then sends new
requests. This times that exchange alone, a step's round trip, over three channels:

- pipe: multiprocessing.connection over a socketpair, messages pickled;
- zmq: a ZeroMQ PAIR socket over ipc:// (pyzmq), messages pickled (vLLM v1's engine core talks
  ZeroMQ with msgpack; pickle stands in, msgpack is not installed here);
- shm: one shared-memory ring per direction (multiprocessing.shared_memory), length-framed
  bytes, the reader woken by an eventfd (no busy polling: on a 2-core machine a spinning reader
  takes a core from the engine).

Per step the "engine" child answers a request of B sequence ids with B (id, token) pairs packed
as int32 arrays (tokens, not text, cross). Reported per channel and B: the round trip's median
and 99th percentile and the CPU both processes spend per step (getrusage), with the machine.

    .venv/bin/python perf/engine/channel_bench.py --steps 2000 --batch 1,16,64,256 \\
        --out perf/results/2026-11-29-engine-channel
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import resource
import struct
import sys
import tempfile
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.machine import cpu_flags, cpu_model, git_commit  # noqa: E402

RING_BYTES = 1 << 20
WARMUP = 200  # untimed round trips first (imports, page faults, socket buffers)


class Ring:
    """A single-producer single-consumer byte ring in shared memory: [head u64][tail u64][data];
    messages framed by a u32 length; the writer rings an eventfd after each message."""

    def __init__(self, shm: SharedMemory, doorbell: int) -> None:
        self.shm, self.buf, self.doorbell = shm, shm.buf, doorbell
        self.size = len(shm.buf) - 16

    def _get(self, at: int) -> int:
        return struct.unpack_from("<Q", self.buf, at)[0]

    def _copy_in(self, pos: int, data: bytes) -> None:
        start = pos % self.size
        first = min(len(data), self.size - start)
        self.buf[16 + start:16 + start + first] = data[:first]
        self.buf[16:16 + len(data) - first] = data[first:]

    def _copy_out(self, pos: int, n: int) -> bytes:
        start = pos % self.size
        first = min(n, self.size - start)
        return bytes(self.buf[16 + start:16 + start + first]) + bytes(self.buf[16:16 + n - first])

    def send(self, data: bytes) -> None:
        head, tail = self._get(0), self._get(8)
        if head - tail + 4 + len(data) > self.size:
            raise BufferError("ring full")  # the benchmark's messages never fill it
        self._copy_in(head, struct.pack("<I", len(data)))
        self._copy_in(head + 4, data)
        struct.pack_into("<Q", self.buf, 0, head + 4 + len(data))
        os.eventfd_write(self.doorbell, 1)

    def recv(self) -> bytes:
        while self._get(0) == self._get(8):
            os.eventfd_read(self.doorbell)  # blocks until the writer rings
        tail = self._get(8)
        n = struct.unpack("<I", self._copy_out(tail, 4))[0]
        data = self._copy_out(tail + 4, n)
        struct.pack_into("<Q", self.buf, 8, tail + 4 + n)
        return data


def step_output(ids: np.ndarray) -> bytes:
    """What the engine returns per step: each sequence's id and one new token, as int32."""
    return pickle.dumps((ids, (ids * 7 + 3).astype(np.int32)), protocol=5)


def engine(kind: str, address, steps: int) -> None:
    """The child: answer `steps` requests on channel `kind`."""
    if kind == "pipe":
        from multiprocessing.connection import Client

        conn = Client(address)
        send, recv = conn.send_bytes, conn.recv_bytes
    elif kind == "zmq":
        import zmq

        sock = zmq.Context().socket(zmq.PAIR)
        sock.connect(address)
        send, recv = sock.send, sock.recv
    else:
        names, bells = address
        inbox, outbox = Ring(SharedMemory(names[0]), bells[0]), Ring(SharedMemory(names[1]), bells[1])
        send, recv = outbox.send, inbox.recv
    for _ in range(WARMUP + steps):
        ids = pickle.loads(recv())
        send(step_output(ids))


def run(kind: str, batch: int, steps: int) -> dict:
    """Time `steps` round trips of `batch` sequences over `kind` with a child engine."""
    ctx = mp.get_context("fork")
    cleanup = []
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # children joined before this run
    if kind == "pipe":
        from multiprocessing.connection import Listener

        listener = Listener(family="AF_UNIX")
        child = ctx.Process(target=engine, args=(kind, listener.address, steps))
        child.start()
        conn = listener.accept()
        send, recv = conn.send_bytes, conn.recv_bytes
    elif kind == "zmq":
        import zmq

        path = tempfile.mktemp(prefix="sf-chan-")
        sock = zmq.Context().socket(zmq.PAIR)
        sock.bind(f"ipc://{path}")
        child = ctx.Process(target=engine, args=(kind, f"ipc://{path}", steps))
        child.start()
        send, recv = sock.send, sock.recv
        cleanup.append(lambda: os.path.exists(path) and os.unlink(path))
    else:
        shms = [SharedMemory(create=True, size=RING_BYTES + 16) for _ in range(2)]
        for s in shms:
            s.buf[:16] = bytes(16)
        bells = [os.eventfd(0), os.eventfd(0)]
        child = ctx.Process(target=engine, args=(kind, ([s.name for s in shms], bells), steps))
        child.start()
        outbox, inbox = Ring(shms[0], bells[0]), Ring(shms[1], bells[1])
        send, recv = outbox.send, inbox.recv
        cleanup += [s.unlink for s in shms]
    ids = np.arange(batch, dtype=np.int32)
    for _ in range(WARMUP):
        send(pickle.dumps(ids, protocol=5))
        pickle.loads(recv())
    times = []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t = time.perf_counter()
        send(pickle.dumps(ids, protocol=5))
        pickle.loads(recv())
        times.append(time.perf_counter() - t)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    child.join()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # now with this run's child
    engine_cpu = (kids1.ru_utime - kids0.ru_utime) + (kids1.ru_stime - kids0.ru_stime)
    for c in cleanup:
        c()
    times.sort()
    ours = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"channel": kind, "batch": batch, "steps": steps, "p50_us": times[len(times) // 2] * 1e6,
            "p99_us": times[int(len(times) * 0.99)] * 1e6, "front_cpu_us_per_step": ours / steps * 1e6,
            "engine_cpu_us_per_step": engine_cpu / steps * 1e6}  # its warm-up included


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--channels", default="pipe,zmq,shm")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    records = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for kind in args.channels.split(","):
            rec = run(kind, batch, args.steps)
            records.append(rec)
            print(f"[channel] {kind:4s} batch {batch:4d}: p50 {rec['p50_us']:7.1f} us, p99 {rec['p99_us']:7.1f} us, "
                  f"front CPU {rec['front_cpu_us_per_step']:6.1f} us/step", flush=True)
    doc = {"benchmark": "engine channel round trip", "command": " ".join([".venv/bin/python", *sys.argv]),
           "commit": git_commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
                       "loadavg": Path("/proc/loadavg").read_text().split()[:3]},
           "records": records}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "channel.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
