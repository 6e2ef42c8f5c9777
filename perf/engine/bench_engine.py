"""Offline engine benchmark: tokens/s and the share of step time spent outside the forward.

    .venv/bin/python perf/engine/bench_engine.py --size tiny --num-seqs 64

"Outside the forward" is everything the engine does per step besides the model itself:
scheduling, building the ragged batch, sampling, stop checks and detokenization. It is
reported over the steady-state steps in which all `--num-seqs` sequences are decoding.
Results are printed and written to perf/results/bench_engine-<size>.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitfuse import EngineConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit, mem_gib  # noqa: E402

from splitfuse.tools.demo_model import build_model
from splitfuse.engine.llm_engine import LLMEngine



def machine() -> dict:
    cpu = cpu_model()
    mem_gb = mem_gib()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "mem_gb": round(mem_gb, 1), "device": device,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0]}


def run(args: argparse.Namespace) -> dict:
    model_dir = args.model
    if model_dir is None:
        model_dir = str(Path(tempfile.gettempdir()) / f"splitfuse-bench-{args.size}")
        if not Path(model_dir, "config.json").exists():
            build_model(model_dir, arch="llama", size=args.size)
    engine = LLMEngine(EngineConfig(model=model_dir, token_budget=args.token_budget, block_size=args.block_size,
                                    max_num_seqs=max(args.num_seqs, 1), attention_backend=args.attention_backend,
                                    dtype=args.dtype))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=None)
    prompt = [1] + [5 + (i * 37) % 300 for i in range(args.prompt_len - 1)]

    def one_round(tag: str) -> tuple[list, float, int]:
        for i in range(args.num_seqs):
            engine.add_prepared(f"{tag}-{i}", list(prompt), params)
        steps, generated = [], 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outs = engine.step()
            generated += sum(len(o.delta_token_ids) for o in outs)
            if engine.last_step is not None:
                steps.append(engine.last_step)
        return steps, time.perf_counter() - start, generated

    one_round("warmup")
    steps, wall, generated = one_round("run")
    steady = [s for s in steps if s.num_running == args.num_seqs and s.num_prompt_tokens == 0]
    total = sum(s.duration_s for s in steady)
    outside = sum(s.duration_s - s.forward_s for s in steady)
    result = {
        "benchmark": "bench_engine",
        "model": {"size": args.size, "path": model_dir},
        "config": vars(args),
        "machine": machine(),
        "commit": git_commit(),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "generated_tokens_per_s": round(generated / wall, 1),
        "steady_decode_steps": len(steady),
        "steady_step_ms_median": round(1e3 * statistics.median(s.duration_s for s in steady), 3) if steady else None,
        "steady_forward_ms_median": round(1e3 * statistics.median(s.forward_s for s in steady), 3) if steady else None,
        "outside_forward_share": round(outside / total, 4) if total else None,
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: build a random Llama of --size)")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "bench"])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    print(f"\n{result['generated_tokens_per_s']} generated tok/s; outside-forward share "
          f"{100 * (result['outside_forward_share'] or 0):.1f}% of steady decode step time "
          f"({args.num_seqs} running sequences, {args.size} model)")
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"bench_engine-{args.size}-{args.num_seqs}seqs.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
