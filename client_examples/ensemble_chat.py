"""A chat through Triton's `ensemble`: the messages go as JSON in `text_input` with
`apply_chat_template=true`, and the `preprocessing` model renders them with the checkpoint's
chat template before the engine generates (gRPC streaming, tritonclient).

    python client_examples/ensemble_chat.py --url localhost:8001 "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

NP_TYPES = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}


def tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    arr = np.array([[value]], dtype=NP_TYPES[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--system", default="You are a helpful assistant.")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    messages = [{"role": "system", "content": args.system}, {"role": "user", "content": args.question}]
    inputs = [tensor("text_input", json.dumps(messages).encode(), "BYTES"),
              tensor("apply_chat_template", True, "BOOL"),
              tensor("max_tokens", args.max_tokens, "INT32"),
              tensor("temperature", 0.0, "FP32"),
              tensor("stream", True, "BOOL")]
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    finish = ""
    try:
        while True:
            result, error = events.get(timeout=300)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                sys.stdout.write(text.reshape(-1)[0].decode("utf-8"))
                sys.stdout.flush()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.size and reason.reshape(-1)[0]:
                finish = reason.reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    print(f"\n[finish: {finish}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
