"""Stream a generation over gRPC with tritonclient (decoupled model: stream API).

    python client_examples/grpc_stream.py --prompt "hello world" --max-tokens 64
    python client_examples/grpc_stream.py --model llm --cancel-after 5     # cancel mid-stream

Cancelling: `stop_stream(cancel_requests=True)` reaches the `llm` model, which aborts the
sequence and frees its KV blocks. For the `ensemble` model Triton 2.51 does not forward the
cancellation, so this script also sends an explicit stop to `llm`: stop=true with the stop_handle
that the generation's first response carried (asked for with return_stop_handle=true; a request
id alone stops nothing, since any client could send another's).
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
import uuid

import numpy as np
import tritonclient.grpc as grpcclient


NP_TYPES = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}


def tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    """One value with the batch dimension: shape [1, 1], as the models expect."""
    arr = np.array([[value]], dtype=NP_TYPES[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="ensemble", choices=["ensemble", "llm"])
    p.add_argument("--prompt", default="hello world")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cancel-after", type=int, default=None, metavar="N", help="cancel after N responses")
    args = p.parse_args()

    inputs = [
        tensor("text_input", args.prompt.encode(), "BYTES"),
        tensor("max_tokens", args.max_tokens, "INT32"),
        tensor("temperature", args.temperature, "FP32"),
        tensor("stream", True, "BOOL"),
        tensor("return_num_output_tokens", True, "BOOL"),
        tensor("return_stop_handle", True, "BOOL"),
    ]
    if args.seed is not None:
        inputs.append(tensor("seed", args.seed, "UINT64"))
    request_id = uuid.uuid4().hex
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    # tritonclient calls the stream callback with keyword arguments.
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    start = time.perf_counter()
    client.async_stream_infer(args.model, inputs, request_id=request_id, enable_empty_final_response=True)
    n, first, finish, handle = 0, None, "", ""
    try:
        while True:
            result, error = events.get(timeout=300)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                # Each delta is whole UTF-8: the server never splits a character across responses.
                sys.stdout.write(text.reshape(-1)[0].decode("utf-8"))
                sys.stdout.flush()
                n += 1
                first = first or time.perf_counter()
            handle_out = result.as_numpy("stop_handle")
            if handle_out is not None and handle_out.size:
                handle = handle_out.reshape(-1)[0].decode()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.size and reason.reshape(-1)[0]:
                finish = reason.reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            if args.cancel_after is not None and n >= args.cancel_after:
                client.stop_stream(cancel_requests=True)
                if args.model == "ensemble":
                    stop(args.url, handle)
                finish = "cancelled by the client"
                break
    finally:
        client.close()
    total = time.perf_counter() - start
    ttft = (first - start) if first else float("nan")
    print(f"\n[{n} responses, finish: {finish}, first token {ttft * 1000:.0f} ms, total {total:.2f} s]",
          file=sys.stderr)
    return 0


def stop(url: str, handle: str) -> None:
    """Explicit stop: a request to `llm` with stop=true and the generation's stop handle."""
    events: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer("llm", [tensor("stop", True, "BOOL"), tensor("stop_handle", handle.encode(), "BYTES")])
        _, error = events.get(timeout=30)
        client.stop_stream()
    if error is not None:
        print(f"stop failed: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
