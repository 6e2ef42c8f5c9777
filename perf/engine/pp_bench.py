#!/usr/bin/env python
"""Pipeline parallelism on one CPU machine: PP=1 with T threads vs PP=2 with T/2 threads per
stage (the same total), offline, on the benchmark model (tp_bench.py's workload and model).

    flock /tmp/splitfuse-bench.lock .venv/bin/python perf/engine/pp_bench.py [--threads 2] [--repeats 3]

Per setting, in a fresh process each: offline throughput (tp_bench's fixed set of requests, all
submitted at once, run to the end) and single-stream latency (one request alone: TTFT, ms per
decode step), and where rank 0's step time goes: the stage-to-stage transfers (sending its hidden
states, waiting for the last stage's logits, which includes the second stage's compute) and
sending the step's batch. Each step goes down the pipeline in one micro-batch per stage (whole
sequences), so the two stages overlap within a step, and with pipeline_steps_in_flight=2 (the
default) across steps too: on the same cores PP=2 can at best match PP=1; this measures by how
much it loses, one step at a time (in flight 1) and two steps in flight. The median of `--repeats` runs is reported. Writes --out
(perf/results/2026-11-29-pipeline/): results.json (every run, machine, commit, command, load) and
summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.machine import machine_info  # noqa: E402
from perf.common.paths import RESULTS  # noqa: E402
from perf.engine.tp_bench import (MODEL, NUM_REQUESTS, OUTPUT_TOKENS, SINGLE_OUTPUT, SINGLE_PROMPT,  # noqa: E402
                                  _ensure_model, _generate, _requests, _run_engine)


def _run_with_transfers(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    pipe = engine.runner.pipe
    before = pipe.transfer_s if pipe else 0.0
    run = _run_engine(engine, prompts, max_tokens)
    run["transfer_s"] = (pipe.transfer_s - before) if pipe else 0.0
    return run


def run_setting(pp: int, in_flight: int, threads: int, repeats: int) -> dict:
    """One setting, in this process."""
    import random

    from splitfuse import LLMEngine, SamplingParams
    from splitfuse.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(MODEL), dtype="float32", pipeline_parallel_size=pp,
                                    pipeline_steps_in_flight=in_flight, num_threads=threads,
                                    enable_prefix_caching=False))
    try:
        prompts = _requests(engine.vocab_size)
        rng = random.Random(1)
        single = [[1] + [rng.randrange(3, engine.vocab_size) for _ in range(SINGLE_PROMPT - 1)]]
        _run_engine(engine, prompts[:4], 8)  # warm-up: first-touch of weights and caches
        tokens = [o.token_ids for o in _generate(engine, prompts[:4], SamplingParams(max_tokens=16, temperature=0.0))]
        return {
            "pp": pp, "steps_in_flight": engine.steps_in_flight, "threads_total": threads, "threads_per_rank": max(1, threads // pp),
            "throughput": [_run_with_transfers(engine, prompts, OUTPUT_TOKENS) for _ in range(repeats)],
            "single_stream": [_run_with_transfers(engine, single, SINGLE_OUTPUT) for _ in range(repeats)],
            "greedy_tokens": tokens,
        }
    finally:
        engine.shutdown()


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Pipeline parallelism on one CPU machine: PP=1 vs PP=2, same total threads",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB; commit {m['git_commit']}  ",
        f"Load (uptime) before: {results['load_before']}; after: {results['load_after']}  ",
        "Model: perf/.cache/bench-llama (demo_model --size bench: hidden 512, 8 layers, 8 heads / 4 KV heads, "
        f"vocab 8192), fp32; PP=2 puts layers 0-3 on rank 0, 4-7 and the LM head on rank 1, each step in two "
        f"micro-batches. Shares are of the run's wall time on rank 0. Median of {results['repeats']} runs.",
        "",
        f"Offline: {NUM_REQUESTS} requests, prompts 64-255 tokens (seeded), {OUTPUT_TOKENS} output tokens each.  ",
        f"Single stream: one {SINGLE_PROMPT}-token prompt, {SINGLE_OUTPUT} output tokens.",
        "",
        "| setting | offline gen tok/s | offline processed tok/s | single TTFT ms | single decode ms/step "
        "| rank 0 waiting on transfers (offline / single) | step-send share (offline / single) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in results["settings"]:
        th, ss = s["throughput"], s["single_stream"]

        def share(runs, key):
            return 100 * statistics.median(r[key] / r["wall_s"] for r in runs)

        lines.append(
            f"| PP={s['pp']}, {s['threads_per_rank']} thread(s)/rank, {s.get('steps_in_flight', 1)} step(s) in flight | {_median(th, 'generated_tok_s'):.0f} "
            f"| {_median(th, 'processed_tok_s'):.0f} | {1e3 * _median(ss, 'ttft_s'):.1f} "
            f"| {_median(ss, 'decode_ms_per_step'):.2f} | {share(th, 'transfer_s'):.1f}% / {share(ss, 'transfer_s'):.1f}% "
            f"| {share(th, 'send_step_s'):.1f}% / {share(ss, 'send_step_s'):.1f}% |")
    same = len({json.dumps(s["greedy_tokens"]) for s in results["settings"]}) == 1
    lines += ["", f"Greedy tokens of 4 requests identical across settings: {same}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "2026-11-29-pipeline"))
    ap.add_argument("--setting", help=argparse.SUPPRESS)  # internal: run one "pp:in_flight", print JSON
    args = ap.parse_args()
    if args.setting:
        pp, in_flight = map(int, args.setting.split(":"))
        print("RESULT " + json.dumps(run_setting(pp, in_flight, args.threads, args.repeats)), flush=True)
        return
    _ensure_model()
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
               "load_before": os.getloadavg(), "repeats": args.repeats, "settings": []}
    for setting in ("1:1", "2:1", "2:2"):
        out = subprocess.run([sys.executable, __file__, "--setting", setting, "--threads", str(args.threads),
                              "--repeats", str(args.repeats)], capture_output=True, text=True, check=True).stdout
        results["settings"].append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    results["load_after"] = os.getloadavg()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    summary = summarize(results)
    (out_dir / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
