"""Many concurrent streaming clients (asyncio, tritonclient.grpc.aio), with latency numbers.

    python client_examples/concurrent_clients.py --clients 16 --max-tokens 64

Each client opens its own gRPC stream, sends one request and reads its deltas until the
response whose finish_reason is set, then half-closes the stream. Prints time to first
token, inter-token latency and the aggregate token rate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

NP_TYPES = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}


def tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    arr = np.array([[value]], dtype=NP_TYPES[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


async def one_client(url: str, model: str, i: int, prompt: str, max_tokens: int, temperature: float) -> dict:
    inputs = [
        tensor("text_input", f"{prompt} ({i})".encode(), "BYTES"),
        tensor("max_tokens", max_tokens, "INT32"),
        tensor("temperature", temperature, "FP32"),
        tensor("seed", i, "UINT64"),
        tensor("stream", True, "BOOL"),
    ]
    done = asyncio.Event()

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": f"client-{i}"}
        await done.wait()  # keep the stream open until the last response arrived

    async with aioclient.InferenceServerClient(url) as client:
        start = time.perf_counter()
        stamps: list[float] = []
        counts: list[int] = []  # tokens in each response (a response may carry several)
        tokens = 0
        chunks: list[bytes] = []
        finish = ""
        async for result, error in client.stream_infer(inputs_iterator=requests()):
            if error is not None:
                done.set()
                raise RuntimeError(f"client {i}: {error}")
            n = result.as_numpy("output_ids").size
            if n:
                stamps.append(time.perf_counter())
                counts.append(n)
            tokens += n
            chunks.append(result.as_numpy("text_output").reshape(-1)[0])
            finish = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if finish:
                # The last response. Half-close the stream and let the server end it: the aio
                # client cannot ask for Triton's final flag, and closing the channel right
                # here can cancel an ensemble request that is still completing (Triton 2.51
                # then never unloads the ensemble).
                done.set()
    # Inter-token latency per token, not per response: a response of n tokens after a gap g counts
    # n gaps of g / n (as the server's splitfuse_inter_token_latency_seconds does).
    gaps = [(b - a) / n for a, b, n in zip(stamps, stamps[1:], counts[1:]) for _ in range(n)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "tokens": tokens,
            "finish": finish, "text": b"".join(chunks).decode("utf-8")}


async def run(args) -> int:
    start = time.perf_counter()
    results = await asyncio.gather(*(one_client(args.url, args.model, i, args.prompt, args.max_tokens,
                                                args.temperature) for i in range(args.clients)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"]) or [float("nan")]
    finishes = {f: sum(r["finish"] == f for r in results) for f in {r["finish"] for r in results}}
    print(f"{args.clients} clients, {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s; finish {finishes}")
    print(f"time to first token: median {statistics.median(ttft) * 1000:.0f} ms, max {ttft[-1] * 1000:.0f} ms")
    print(f"inter-token latency: median {statistics.median(gaps) * 1000:.1f} ms, "
          f"p90 {gaps[int(0.9 * (len(gaps) - 1))] * 1000:.1f} ms")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt", default="the quick brown fox")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
