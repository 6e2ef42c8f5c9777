"""vLLM's `LLM.generate` on a request file, timed; run with vLLM's own interpreter
(perf/.venv-vllm/bin/python) by `offline_compare.py`.

usage: vllm_offline.py REQUESTS_JSON OUT_JSON --model DIR [--dtype D] [--single-stream JSON]
       [--max-num-batched-tokens N]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--single-stream", help="requests timed alone, one after another, after the batch")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    reqs = json.load(open(args.requests))
    extra = {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False,
              gpu_memory_utilization=0.2, **extra)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                             ignore_eos=True) for r in reqs]
    # Warm-up on a short request so start-up compilation is not timed.
    llm.generate([{"prompt_token_ids": reqs[0]["prompt"][:16]}],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    single = []
    for r in json.load(open(args.single_stream)) if args.single_stream else []:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": r["prompt"]}], SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r["max_tokens"], ignore_eos=True), use_tqdm=False)
        single.append(time.perf_counter() - start)
    json.dump({"wall_s": wall, "single_stream_s": single, "outputs": [list(o.outputs[0].token_ids) for o in outs]},
              open(args.out, "w"))


if __name__ == "__main__":
    main()
