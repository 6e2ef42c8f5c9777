#!/usr/bin/env python
"""Tensor parallelism on one CPU machine: TP=1 with T threads vs TP=2 with T/2 threads per rank
(the same total), offline, on the benchmark model.

    flock /tmp/splitfuse-bench.lock .venv/bin/python perf/engine/tp_bench.py [--threads 2] [--repeats 3]

Per setting, in a fresh process each (so no OpenMP pool or process group carries over):
* offline throughput: a fixed set of requests (seeded prompt lengths, fixed output lengths,
  ignore_eos, greedy) submitted at once, run to the end: generated and processed tokens/s;
* single-stream latency: one request alone: time to first token and ms per decode step;
* where rank 0's step time goes: the forward pass, of it the all-reduces (moving the partial
  sums and waiting for the other rank) and sending the step's batch to the other rank.
Plus the floor under the all-reduce share: gloo's all-reduce between two otherwise idle processes
on this machine, for the tensor sizes a step all-reduces (`tokens x hidden` fp32).
The median of `--repeats` runs is reported. Writes --out (perf/results/2026-11-23-tensor-parallel/):
results.json (every run, machine, commit, command, load) and summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS, CACHE  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402

MODEL = CACHE / "bench-llama"
NUM_REQUESTS = 32
OUTPUT_TOKENS = 64
SINGLE_PROMPT, SINGLE_OUTPUT = 64, 128


def _ensure_model() -> None:
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "splitfuse.tools.demo_model", str(MODEL), "--arch", "llama", "--size",
                        "bench"], check=True)


def _requests(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 256))] for _ in range(NUM_REQUESTS)]


def _run_engine(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from splitfuse import SamplingParams

    runner = engine.runner
    group, leader = runner.group, runner.leader
    reduce0 = group.all_reduce_s if group else 0.0
    calls0 = group.all_reduce_calls if group else 0
    send0 = leader.send_s if leader else 0.0
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps, forward_s, first_token_s = [], 0.0, None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stats = engine.last_step  # None for a pipeline step that collected nothing yet
        if stats is not None:
            steps.append(stats.duration_s)
            forward_s += stats.forward_s
        if first_token_s is None and any(o.delta_token_ids for o in outputs):
            first_token_s = time.perf_counter() - start
    wall = time.perf_counter() - start
    generated = len(prompts) * max_tokens
    return {
        "wall_s": wall,
        "steps": len(steps),
        "generated_tok_s": generated / wall,
        "processed_tok_s": (generated + sum(map(len, prompts))) / wall,
        "ttft_s": first_token_s,
        "decode_ms_per_step": 1e3 * statistics.median(steps[1:]) if len(steps) > 1 else None,
        "step_s": sum(steps),
        "forward_s": forward_s,
        "all_reduce_s": (group.all_reduce_s - reduce0) if group else 0.0,
        "all_reduce_calls": (group.all_reduce_calls - calls0) if group else 0,
        "send_step_s": (leader.send_s - send0) if leader else 0.0,
    }


def run_setting(tp: int, threads: int, repeats: int) -> dict:
    """One setting, in this process."""
    from splitfuse import LLMEngine
    from splitfuse.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(MODEL), dtype="float32", tensor_parallel_size=tp, num_threads=threads,
                                    enable_prefix_caching=False))
    try:
        prompts = _requests(engine.vocab_size)
        rng = random.Random(1)
        single = [[1] + [rng.randrange(3, engine.vocab_size) for _ in range(SINGLE_PROMPT - 1)]]
        _run_engine(engine, prompts[:4], 8)  # warm-up: first-touch of weights and caches
        # Greedy tokens must not depend on the layout (the same check as the tests, on this model).
        from splitfuse import SamplingParams
        tokens = [o.token_ids for o in _generate(engine, prompts[:4], SamplingParams(max_tokens=16, temperature=0.0))]
        return {
            "tp": tp, "threads_total": threads, "threads_per_rank": max(1, threads // tp),
            "throughput": [_run_engine(engine, prompts, OUTPUT_TOKENS) for _ in range(repeats)],
            "single_stream": [_run_engine(engine, single, SINGLE_OUTPUT) for _ in range(repeats)],
            "greedy_tokens": tokens,
        }
    finally:
        engine.shutdown()


def _generate(engine, prompts, params):
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[f"g{i}"] for i in range(len(prompts))]


def gloo_latency(rank: int, port: int) -> dict[int, float] | None:
    """Microseconds per all-reduce of [rows, 512] fp32 between two processes (run by both ranks)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for rows in (1, 64, 512):
        t = torch.randn(rows, 512)
        for _ in range(50):
            dist.all_reduce(t)
        start, n = time.perf_counter(), 300
        for _ in range(n):
            dist.all_reduce(t)
        out[rows] = 1e6 * (time.perf_counter() - start) / n
    dist.destroy_process_group()
    return out if rank == 0 else None


def _run_gloo_latency() -> dict:
    from splitfuse.utils.ports import free_port

    port = str(free_port())
    peer = subprocess.Popen([sys.executable, __file__, "--gloo-rank", "1", "--port", port], stdout=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, __file__, "--gloo-rank", "0", "--port", port], capture_output=True,
                         text=True, check=True).stdout
    peer.wait()
    return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(results: dict) -> str:
    lines = [
        "# Tensor parallelism on one CPU machine: TP=1 vs TP=2, same total threads",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        f"{results['machine']['ram_gib']} GiB; commit {results['machine']['git_commit']}  ",
        f"Load (uptime) before: {results['load_before']}; after: {results['load_after']}  ",
        f"Model: perf/.cache/bench-llama (demo_model --size bench: hidden 512, 8 layers, 8 heads / 4 KV heads, "
        f"vocab 8192), fp32. Median of {results['repeats']} runs.",
        "",
        f"Offline: {NUM_REQUESTS} requests, prompts 64-255 tokens (seeded), {OUTPUT_TOKENS} output tokens each.  ",
        f"Single stream: one {SINGLE_PROMPT}-token prompt, {SINGLE_OUTPUT} output tokens.",
        "",
        "| setting | offline gen tok/s | offline processed tok/s | single TTFT ms | single decode ms/step "
        "| all-reduce share (offline / single) | ms per all-reduce (single) | step-send share (offline / single) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in results["settings"]:
        th, ss = s["throughput"], s["single_stream"]

        def share(runs, key):
            return 100 * statistics.median(r[key] / r["step_s"] for r in runs)

        def per_call(runs):
            return statistics.median(1e3 * r["all_reduce_s"] / r["all_reduce_calls"] if r["all_reduce_calls"] else 0.0
                                     for r in runs)

        lines.append(
            f"| TP={s['tp']}, {s['threads_per_rank']} thread(s)/rank | {_median(th, 'generated_tok_s'):.0f} "
            f"| {_median(th, 'processed_tok_s'):.0f} | {1e3 * _median(ss, 'ttft_s'):.1f} "
            f"| {_median(ss, 'decode_ms_per_step'):.2f} | {share(th, 'all_reduce_s'):.1f}% / "
            f"{share(ss, 'all_reduce_s'):.1f}% | {per_call(ss):.3f} "
            f"| {share(th, 'send_step_s'):.1f}% / {share(ss, 'send_step_s'):.1f}% |")
    same = len({json.dumps(s["greedy_tokens"]) for s in results["settings"]}) == 1
    lines += ["", f"Greedy tokens of 4 requests identical across settings: {same}.", "",
              "gloo all-reduce between two otherwise idle processes on this machine (1 thread each): "
              + ", ".join(f"{rows} x 512 fp32: {us:.0f} us" for rows, us in results["gloo_allreduce_us"].items())
              + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "2026-11-23-tensor-parallel"))
    ap.add_argument("--setting", type=int, help=argparse.SUPPRESS)  # internal: run one TP size, print JSON
    ap.add_argument("--gloo-rank", type=int, help=argparse.SUPPRESS)  # internal: one side of gloo_latency
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gloo_rank is not None:
        print("RESULT " + json.dumps(gloo_latency(args.gloo_rank, args.port)), flush=True)
        return
    if args.setting:
        print("RESULT " + json.dumps(run_setting(args.setting, args.threads, args.repeats)), flush=True)
        return
    _ensure_model()
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
               "load_before": os.getloadavg(), "repeats": args.repeats, "settings": []}
    for tp in (1, 2):
        out = subprocess.run([sys.executable, __file__, "--setting", str(tp), "--threads", str(args.threads),
                              "--repeats", str(args.repeats)], capture_output=True, text=True, check=True).stdout
        results["settings"].append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    results["gloo_allreduce_us"] = _run_gloo_latency()
    results["load_after"] = os.getloadavg()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    summary = summarize(results)
    (out_dir / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
