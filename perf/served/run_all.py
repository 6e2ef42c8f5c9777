#!/usr/bin/env python
"""Side-by-side FastGen-style comparison on this machine, with plots and a markdown summary.

For each system in turn (one server at a time, so they never share the CPU):
  * splitfuse / prefill_first / orca [@TOKEN_BUDGET]: our Triton server (`splitfuse.launcher.serve`)
    with that `scheduler_policy` (and token budget; everything else identical), driven through
    the `ensemble` model over Triton's HTTP generate_stream (server-sent events, read by the same
    client code as vLLM's stream; `--triton-protocol grpc`: tritonclient gRPC streaming);
  * engine[@TOKEN_BUDGET]: our SplitFuse engine inside this process (EngineLoop, no server),
    driven by the same clients: the reference that says what serving costs;
  * vllm / vllm_2c: vLLM's CPU build (perf/.venv-vllm) serving the same checkpoint through its
    OpenAI-compatible server on loopback, driven with streaming /v1/completions (vllm: its own
    CPU thread binding, vllm_2c: compute threads on both cores);
  * llamacpp: llama.cpp's llama-server (perf/peers/llamacpp/build.sh) on the GGUF file that
    --model-dir was converted from (or --gguf), all cores, a slot per client, the same client.
--model-dir may name a .gguf file: it is converted once (as `make serve` does) for our systems
and the workload's tokenizer, and served as it is by llama.cpp; add `--param quantization=gguf`
for our engine to multiply its blocks packed.
Any system may end in a precision: `:bf16` (our dtype=bfloat16, vLLM's --dtype bfloat16) or, for
ours, `:int8` (quantization=int8); the summary compares each peer with ours in the peer's
precision and our low-precision systems with the same system in float32.
Every system gets the same drawn request list, the same client counts and request counts.

    .venv/bin/python perf/served/run_all.py                       # full comparison (~25 min here)
    .venv/bin/python perf/served/run_all.py --systems splitfuse,prefill_first --clients 1,4
    .venv/bin/python perf/served/run_all.py --systems splitfuse@256,splitfuse@256:bf16,splitfuse@256:int8,vllm_2c:bf16
    .venv/bin/python perf/served/run_all.py --report-only         # plots + summary from raw/

Outputs under --out (default perf/results/2026-11-22-served-8-systems/): raw/<system>.json.gz (every request's token
arrival times) and raw/meta.json, metrics.csv, throughput_latency.png, effective_throughput.png,
token_latency.png, summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS, CACHE, VENV_VLLM  # noqa: E402

from perf.served.closed_loop import parse_ints  # noqa: E402
from perf.served.fastgen_report import RELAXED_PROMPT_TPS, report, save_raw  # noqa: E402
from perf.served.fastgen_servers import log, run_engine, run_llamacpp, run_triton, run_vllm  # noqa: E402
from perf.common.helpers import add_output_options  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402
from perf.common.roofline import Roofline, workload_floor  # noqa: E402
from perf.common.systems import (BUDGETED, ENGINE_SYSTEM, LLAMACPP_SYSTEMS, SYSTEM_ORDER, VLLM_DTYPES,  # noqa: E402
                                 VLLM_SYSTEMS, base_of, budget_of, check_precision, file_stem, precision_of)
from perf.common.workload import VARIANCE, ensure_model, make_workload, model_info  # noqa: E402


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="splitfuse@128,splitfuse@256,splitfuse@512,prefill_first@128,"
                    "prefill_first@2048,orca@2048,vllm,vllm_2c",
                    help="comma list: splitfuse|prefill_first|orca[@TOKEN_BUDGET], vllm, vllm_2c, llamacpp")
    ap.add_argument("--model-dir", default=str(CACHE / "bench-llama"))
    ap.add_argument("--model-size", default="bench", help="demo_model size built when --model-dir is missing")
    # Up to 128: vLLM-CPU bf16 still gains ~20% from 16 to 32 clients on the benchmark model, ~12%
    # more to 64 and ~7% to 128, so a sweep that stops early compares our saturated server with a
    # rising one (the summary names every system still rising at the top of the sweep).
    ap.add_argument("--clients", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--prompt-mean", type=float, default=512)
    ap.add_argument("--gen-mean", type=float, default=64)
    ap.add_argument("--variance", type=float, default=VARIANCE)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--point-time-limit", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--token-budget", type=int, default=128, help="engine token_budget where a system names none")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="extra engine parameter for our server (all policies)")
    ap.add_argument("--triton-model", default="ensemble", choices=("ensemble", "llm"))
    ap.add_argument("--triton-protocol", default="http", choices=("http", "grpc"),
                    help="how the clients stream from our server: Triton's HTTP generate_stream (server-sent "
                         "events, the same client code and transport as vLLM's /v1/completions) or "
                         "tritonclient gRPC (a heavier client on the same cores: ~0.16 against ~0.10 cores "
                         "at 32 clients here)")
    ap.add_argument("--max-restarts", type=int, default=3,
                    help="tritonserver restarts per system when it exits during a point")
    ap.add_argument("--vllm-python", default=str(VENV_VLLM / "bin" / "python"))
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-ready-timeout", type=float, default=600)
    ap.add_argument("--gguf", default=None, help="the GGUF file llama.cpp serves (default: the one --model-dir "
                    "is or was converted from)")
    ap.add_argument("--llamacpp-threads", type=int, default=0, help="llama-server -t (0: every core)")
    ap.add_argument("--llamacpp-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--token-clients", type=int, default=16, help="client count of the token-latency bars")
    add_output_options(ap, RESULTS / "2026-11-22-served-8-systems", CACHE / "run")
    ap.add_argument("--headline-system", default=None,
                    help="our system(s) the targets table compares, comma-separated "
                         "(default: the first splitfuse system)")
    ap.add_argument("--relaxed-prompt-tps", type=float, default=RELAXED_PROMPT_TPS,
                    help="supplementary first-token SLA (tokens/s); 0 to leave it out")
    ap.add_argument("--both-orders", action="store_true",
                    help="run the systems in the given order into --out, then reversed into OUT-reversed")
    args = ap.parse_args(argv)
    if args.both_orders:  # two runs, each recorded with its own command line (the last option wins)
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--both-orders"]
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        main(rest + ["--systems", ",".join(systems), "--out", args.out])
        main(rest + ["--systems", ",".join(systems[::-1]), "--out", args.out.rstrip("/") + "-reversed"])
        return

    out = Path(args.out)
    raw = out / "raw"
    if args.note and (raw / "meta.json").is_file():
        m = json.loads((raw / "meta.json").read_text())
        m["notes"] = list(dict.fromkeys(m.get("notes", []) + args.note))
        (raw / "meta.json").write_text(json.dumps(m, indent=1))
    if args.report_only:
        log(f"wrote {report(out, args.token_clients, args.relaxed_prompt_tps, args.headline_system)}")
        return
    raw.mkdir(parents=True, exist_ok=True)
    if args.model_dir.endswith(".gguf"):  # converted once, as `make serve` does; llama.cpp serves the file
        from splitfuse.models.gguf_checkpoint import prepare_checkpoint

        args.gguf = args.gguf or str(Path(args.model_dir).resolve())
        args.model_dir = prepare_checkpoint(args.model_dir)
    ensure_model(args.model_dir, args.model_size)
    clients = parse_ints(args.clients)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if base_of(s) not in SYSTEM_ORDER or (budget_of(s) and base_of(s) not in BUDGETED):
            raise SystemExit(f"unknown system {s!r}; choose from {SYSTEM_ORDER} (ours may take @BUDGET, "
                             "any may take :bf16, ours :int8)")
        try:
            check_precision(s, vllm=base_of(s) in VLLM_SYSTEMS)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    specs = make_workload(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.variance,
                             args.seed, args.max_model_len)
    meta_path = raw / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.update(
        machine=machine_info(), model=model_info(args.model_dir),
        workload=dict(prompt_mean=args.prompt_mean, gen_mean=args.gen_mean, variance=args.variance, seed=args.seed,
                      num_requests=len(specs),
                      measured_prompt_mean=sum(s.prompt_tokens for s in specs) / len(specs),
                      measured_gen_mean=sum(s.gen_tokens for s in specs) / len(specs)),
        clients=clients, per_client=args.per_client, min_requests=args.min_requests,
        token_budget=args.token_budget, date=time.strftime("%Y-%m-%d %H:%M %Z"),
        command="perf/served/run_all.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    meta["commands"] = list(dict.fromkeys(meta.get("commands", []) + [meta["command"]]))
    meta.setdefault("servers", {})
    meta_path.write_text(json.dumps(meta, indent=1))
    # The roofline, for the dtypes vLLM computes in too: measured before and after the systems.
    floor_dtypes = sorted({VLLM_DTYPES[precision_of(s)] for s in systems if precision_of(s) in VLLM_DTYPES})
    roof = Roofline.measure(os.cpu_count() or 1, floor_dtypes) if floor_dtypes else None
    for s in systems:
        t = time.time()
        started = time.strftime("%Y-%m-%d %H:%M %Z")
        digest = machine_info()["source_digest"]
        try:
            if base_of(s) in VLLM_SYSTEMS:
                res = run_vllm(s, args, specs, clients)
            elif base_of(s) in LLAMACPP_SYSTEMS:
                res = run_llamacpp(s, args, specs, clients)
            elif base_of(s) == ENGINE_SYSTEM:
                res = run_engine(s, args, specs, clients)
            else:
                res = run_triton(s, args, specs, clients)
        except Exception as exc:  # noqa: BLE001 - the other systems still run
            log(f"{s}: FAILED: {type(exc).__name__}: {exc}")
            continue
        res.update(label=s, workload=meta["workload"], system=s, started=started, source_digest=digest,
                   invocation=meta["command"])
        save_raw(raw / f"{file_stem(s)}.json.gz", res)
        meta["servers"][s] = res["server"]
        meta_path.write_text(json.dumps(meta, indent=1))
        log(f"{s}: done in {time.time() - t:.0f}s")
    if roof is not None:
        # The better of before and after, then of that and the best on record for this CPU.
        roof = roof.remeasured().with_record()
        lengths = [(spec.prompt_tokens, spec.gen_tokens) for spec in specs]
        floors = {d: workload_floor(args.model_dir, lengths, d, peak, roof.read_gbs)
                  for d, peak in roof.gemm_peak_gflops.items()}
        # Per dtype: the strict floor (compute and memory overlapped) is the bound no engine can
        # beat; the additive one (nothing overlapped) is what the reports showed before 2026-11-27.
        meta["roofline"] = {**roof.as_dict(),
                            "floors": {d: {**f.as_dict(), "strict_rps": len(lengths) / f.strict_s,
                                           "additive_rps": len(lengths) / f.additive_s} for d, f in floors.items()}}
        meta_path.write_text(json.dumps(meta, indent=1))
    log(f"wrote {report(out, args.token_clients, args.relaxed_prompt_tps, args.headline_system)}")


if __name__ == "__main__":
    main()
