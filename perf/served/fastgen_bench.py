#!/usr/bin/env python
"""FastGen-methodology serving benchmark: closed-loop streaming clients, effective throughput.

Follows the benchmarking methodology of the DeepSpeed-FastGen blog (Nov 2023) and its benchmark
scripts (DeepSpeedExamples, benchmarks/inference/mii), scaled to this machine:

* Workload: prompt and generation lengths drawn from normal distributions whose standard
  deviation is 30% of the mean (the blog's "30% variance"); the blog used prompt means 1200/2600
  and generation means 60/128 on A100/H100 GPUs. Every request generates exactly its drawn length
  (`ignore_eos`, and `min_tokens` for OpenAI servers). The request list is drawn once from a seed,
  so every system sees the same requests in the same order.
* Load: N closed-loop clients (1..32); each sends its next request as soon as the previous one
  has finished streaming.
* Metrics: throughput, effective throughput under the FastGen SLA, token latency percentiles
  (defined in fastgen_metrics.py).

The parts: workload.py (requests), fastgen_metrics.py (SLA math), drivers.py (clients),
closed_loop.py (load and sweep), perf_analyzer_data.py (perf_analyzer input/summary); this file
is the command line.

Drivers: Triton (tritonclient gRPC streaming against our `ensemble` or `llm` model, TensorRT-LLM
tensor names; or `triton-http`: Triton's HTTP generate_stream, server-sent events) and any
OpenAI-compatible server (streaming /v1/completions, e.g. vLLM).

    python perf/served/fastgen_bench.py run --target triton --url 127.0.0.1:8001 --model ensemble \
        --model-dir perf/.cache/bench-llama --clients 1,2,4,8 --out perf/results/raw/splitfuse.json
    python perf/served/fastgen_bench.py run --target openai --url http://127.0.0.1:8000 --model bench ...
    python perf/served/fastgen_bench.py report perf/results/raw/*.json
    python perf/served/fastgen_bench.py pa-input ...     # perf_analyzer --input-data file
    python perf/served/fastgen_bench.py pa-summary ...   # summary of perf_analyzer profile exports
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package

from perf.served.closed_loop import parse_ints, sweep  # noqa: E402
from perf.served.drivers import Driver, OpenAIDriver, TritonDriver, TritonHttpDriver  # noqa: E402
from perf.served.fastgen_metrics import RequestRecord, summarize  # noqa: E402
from perf.load.perf_analyzer_data import summarize_pa_profile, write_pa_input  # noqa: E402
from perf.common.workload import VARIANCE, make_workload  # noqa: E402

def _cmd_run(args: argparse.Namespace) -> None:
    specs = make_workload(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean,
                          args.variance, args.seed, args.max_model_len)
    if args.target == "triton":
        driver: Driver = TritonDriver(args.url, args.model)
    elif args.target == "triton-http":
        driver = TritonHttpDriver(args.url, args.model)
    else:
        driver = OpenAIDriver(args.url, args.model)
    print(f"[fastgen_bench] {args.label or args.target}: {len(specs)} requests, prompt mean "
          f"{args.prompt_mean} gen mean {args.gen_mean}")
    res = sweep(driver, specs, parse_ints(args.clients), args.per_client, args.min_requests,
                args.max_requests, args.time_limit, args.request_timeout)
    res.update(label=args.label or args.target, target=args.target, url=args.url, model=args.model,
               workload=dict(prompt_mean=args.prompt_mean, gen_mean=args.gen_mean,
                             variance=args.variance, seed=args.seed, num_requests=len(specs)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res))
    print(f"[fastgen_bench] wrote {args.out}")


def _cmd_report(args: argparse.Namespace) -> None:
    for f in args.files:
        doc = json.loads(Path(f).read_text())
        print(f"== {doc.get('label', f)}")
        for p in doc["points"]:
            recs = [RequestRecord.from_json(r) for r in p["records"]]
            m = summarize(recs)
            print(json.dumps({"clients": p["clients"], **{k: (round(v, 4) if isinstance(v, float) else v)
                                                          for k, v in m.items()}}))


def _cmd_pa_input(args: argparse.Namespace) -> None:
    specs = make_workload(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean,
                          args.variance, args.seed)
    write_pa_input(specs, args.out)
    print(f"[fastgen_bench] wrote {len(specs)} requests to {args.out}")


def _cmd_pa_summary(args: argparse.Namespace) -> None:
    import csv

    rows = [row for f in args.files for row in summarize_pa_profile(f)]
    rows.sort(key=lambda r: (r["model"], r["concurrency"] or 0))
    if not rows:
        print("[fastgen_bench] no experiments found")
        return
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="checkpoint whose tokenizer sizes the prompts")
    p.add_argument("--prompt-mean", type=float, default=256)
    p.add_argument("--gen-mean", type=float, default=64)
    p.add_argument("--variance", type=float, default=VARIANCE, help="stddev as a share of the mean")
    p.add_argument("--num-requests", type=int, default=256, help="size of the drawn request list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="closed-loop client sweep against one server")
    r.add_argument("--target", choices=("triton", "triton-http", "openai"), required=True)
    r.add_argument("--url", required=True,
                   help="host:grpc_port (triton), host:http_port (triton-http) or http://host:port (openai)")
    r.add_argument("--model", default="ensemble", help="Triton model name or OpenAI served model name")
    r.add_argument("--label", default=None)
    r.add_argument("--clients", default="1,2,4,8,16,32")
    r.add_argument("--per-client", type=int, default=3, help="requests per client at each point")
    r.add_argument("--min-requests", type=int, default=12)
    r.add_argument("--max-requests", type=int, default=512)
    r.add_argument("--time-limit", type=float, default=600.0, help="seconds per point before no new requests")
    r.add_argument("--request-timeout", type=float, default=300.0)
    r.add_argument("--out", required=True)
    _workload_args(r)
    r.set_defaults(func=_cmd_run)
    rep = sub.add_parser("report", help="recompute metrics from raw result files")
    rep.add_argument("files", nargs="+")
    rep.set_defaults(func=_cmd_report)
    pi = sub.add_parser("pa-input", help="write a perf_analyzer --input-data file")
    pi.add_argument("--out", required=True)
    _workload_args(pi)
    pi.set_defaults(func=_cmd_pa_input, num_requests=64)
    ps = sub.add_parser("pa-summary", help="summarise perf_analyzer profile exports into a CSV")
    ps.add_argument("--out", required=True)
    ps.add_argument("files", nargs="+")
    ps.set_defaults(func=_cmd_pa_summary)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
