"""A prefix restored from the prefix cache's tiers against recomputed (docs/kv_tiers.md).

    .venv/bin/python perf/engine/kv_tiers_restore.py MODEL_DIR --prompt 512 --repeats 5

A prompt of --prompt tokens is computed, then another of the same size evicts its blocks from a
KV pool only a little larger than one prompt; the first prompt, its last 8 tokens changed, is
then served again with one token generated: recomputed (no tier), restored from the host-RAM
tier, or from a disk tier (a fresh temporary folder). Prints the median time of that request
over the repeats, its cached tokens, and the raw cost of moving its blocks out of and into the
pool (and their CRC-32, which disk reads pay). One process, the engine inline (LLM.generate);
the restoring step also copies down the blocks the other prompt's eviction freed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from splitfuse import LLM, SamplingParams  # noqa: E402
from splitfuse.kv_tiers.block_codec import decode  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def served_again(model: str, length: int, repeats: int, **tiers) -> tuple[float, int, LLM]:
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [1] + [rng.randrange(3, 500) for _ in range(length - 1)]

    llm = LLM(model, block_size=16, num_kv_blocks=length // 16 + 4, token_budget=512, max_model_len=length + 16,
              **tiers)
    times, cached = [], 0
    for r in range(repeats + 1):  # the first is a warm-up
        p = prompt()
        llm.generate(p, ONE)
        llm.generate(prompt(), ONE)  # evicts p's blocks from the pool
        start = time.perf_counter()
        out = llm.generate(p[:-8] + [7] * 8, ONE)[0]
        if r:
            times.append(time.perf_counter() - start)
            cached = out.num_cached_tokens
    return statistics.median(times), cached, llm


def copy_costs(llm: LLM, blocks: int) -> str:
    runner, fingerprint = llm.engine.runner, llm.engine.offload.fingerprint
    ids = list(range(blocks))
    start = time.perf_counter()
    blobs = runner.read_kv_blocks(ids, fingerprint)
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    payloads = [decode(b, fingerprint) for b in blobs]
    check_s = time.perf_counter() - start
    start = time.perf_counter()
    runner.write_kv_blocks(ids, payloads)
    write_s = time.perf_counter() - start
    return (f"{blocks} blocks of {len(blobs[0])} bytes: out of the pool {read_s * 1e3:.1f} ms, into it "
            f"{write_s * 1e3:.1f} ms, CRC-32 {check_s * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (default: %(default)s)")
    args = parser.parse_args()
    for name, tiers in [("recomputed", {}), ("host-RAM tier", {"kv_offload_memory_gb": 4.0}),
                        ("disk tier", {"kv_offload_dir": tempfile.mkdtemp(prefix="kv-tier-")})]:
        seconds, cached, llm = served_again(args.model, args.prompt, args.repeats, **tiers)
        print(f"{name:14s} prompt {args.prompt}: {seconds * 1e3:8.1f} ms, {cached} tokens cached", flush=True)
        if "kv_offload_memory_gb" in tiers:
            print("  " + copy_costs(llm, args.prompt // 16), flush=True)


if __name__ == "__main__":
    main()
