"""Request priority under a mixed closed-loop load on the engine: what the high class gets, with and
without priority.

    .venv/bin/python perf/engine/priority_bench.py --clients 16 --high-clients 4 --duration 75

`--clients` closed-loop clients run the FastGen workload (`workload.random_id_requests`: prompts
~N(512, 30%), generations ~N(64, 30%), random token ids; greedy, ignore_eos) against an
`EngineLoop` in this process; each submits its next request from the callback that receives its
previous one's final output (engine_closed_loop.py's method: no client thread takes CPU from the
engine). `--high-clients` of them send `priority=--high-priority`, the others 0. The same load runs
twice: with every priority 0 (the baseline), then with those priorities. Each run lasts
--duration seconds (requests still in flight at its end are aborted) and is measured over the
requests that ended in [--warmup, --duration], per class (the high clients, the others, all):
requests completed per second, the share meeting FastGen's SLA and the effective throughput
(perf/served/fastgen_metrics.py: first token within prompt/512 s, and the relaxed prompt/128 s
that suits a CPU's prefill rate, with the EMA of later token gaps under 1/R s for R = 2, 4, 6),
mean and P95 latency, P50/P95 time to first token; and how many cores other processes kept busy
meanwhile (the machine may be shared). Outputs are not held back for grouping
(`stream_interval=1`), so every token's time is its step's. One engine thread (`num_threads=1`):
on a shared 2-core machine a two-thread OpenMP team waits at every barrier for whichever thread
another process has taken the core from (8 requests of 512 + 64 tokens offline, while other
processes kept ~1.3 cores busy: 25 s on two threads, 4.3 s on one).
Written to perf/results/2026-11-29-priority/<name>.json with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common import paths  # noqa: E402
from perf.common.helpers import name_values  # noqa: E402
from perf.common.result_file import write_result  # noqa: E402
from perf.common.workload import add_workload_args, ensure_model, random_id_requests  # noqa: E402
from perf.served.closed_loop import cpu_snapshot, cpu_usage  # noqa: E402
from perf.served.fastgen_metrics import SLA_GEN_RATES, RequestRecord, meets_sla, percentile, ttft  # noqa: E402

from splitfuse.config import split_parameters  # noqa: E402
from splitfuse.engine.loop import EngineLoop  # noqa: E402
from splitfuse.engine.sequence import SamplingParams  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-29-priority"
PROMPT_TPS = {"blog": 512.0, "relaxed": 128.0}  # first-token deadlines: prompt tokens / this many per second


def run(model_dir: str, params: dict[str, str], priorities: list[int], requests: list[dict],
        duration_s: float) -> tuple[list[RequestRecord], dict | None]:
    """One closed-loop run: client c sends priority priorities[c] until `duration_s` has passed,
    when the engine stops (requests in flight are aborted: they end after the window). Every
    request's record (`client` says whose), and the cores this process and others kept busy."""
    config, server = split_parameters({"model": model_dir, **params})
    loop = EngineLoop(config, server=server)
    loop.start()
    warm = threading.Event()
    loop.submit("warmup", [5] * 16, SamplingParams(max_tokens=4, temperature=0.0), lambda o: o.finished and warm.set())
    warm.wait()
    lock = threading.Lock()
    state = {"next": 0}
    records: list[RequestRecord] = []
    cpu_before = cpu_snapshot([os.getpid()])
    start = time.perf_counter()
    deadline = start + duration_s

    def submit(client: int) -> None:
        with lock:
            i = state["next"]
            state["next"] += 1
        r = requests[i % len(requests)]
        rec = RequestRecord(idx=i, client=client, prompt_tokens=len(r["prompt"]), gen_tokens=r["max_tokens"],
                            start=time.perf_counter())
        with lock:
            records.append(rec)
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                priority=priorities[client])
        loop.submit(f"r{i}", r["prompt"], params, lambda out: on_output(client, rec, out))

    def on_output(client: int, rec: RequestRecord, out) -> None:
        now = time.perf_counter()
        if out.delta_token_ids:
            rec.chunks.append((now, len(out.delta_token_ids)))
        if not out.finished:
            return
        rec.end = now
        rec.error = out.error
        if now < deadline:
            submit(client)

    for c in range(len(priorities)):
        submit(c)
    time.sleep(max(0.0, deadline - time.perf_counter()))
    cpu = cpu_usage(cpu_before, cpu_snapshot([os.getpid()]))
    loop.shutdown()
    with lock:
        return list(records), cpu


def class_summary(records: list[RequestRecord], window: tuple[float, float]) -> dict:
    """The requests that ended inside `window` (absolute perf_counter seconds): their rate, SLA
    shares and effective throughput, latency and time to first token."""
    done = [r for r in records if r.ok and window[0] <= r.end <= window[1]]
    seconds = window[1] - window[0]
    out: dict = {"completed": len(done), "requests_per_s": round(len(done) / seconds, 3),
                 "length_mismatches": sum(1 for r in done if r.output_tokens != r.gen_tokens)}
    if not done:
        return out
    latencies = [r.latency for r in done]
    ttfts = [t for t in (ttft(r) for r in done) if t is not None]
    out.update(mean_latency_s=round(statistics.fmean(latencies), 3),
               p95_latency_s=round(percentile(latencies, 95), 3),
               p50_ttft_s=round(percentile(ttfts, 50), 3), p95_ttft_s=round(percentile(ttfts, 95), 3))
    for sla, tps in PROMPT_TPS.items():
        for rate in SLA_GEN_RATES:
            share = sum(1 for r in done if meets_sla(r, rate, tps)) / len(done)
            out[f"sla_ok_frac@{rate:g}/{sla}"] = round(share, 3)
            out[f"effective_rps@{rate:g}/{sla}"] = round(share * len(done) / seconds, 3)
    return out


def measure(model_dir: str, params: dict[str, str], priorities: list[int], high_clients: int,
            requests: list[dict], duration_s: float, warmup_s: float) -> dict:
    """One run summarised for the high class (the first `high_clients` clients, whatever priority
    they send in this run), the others, and all requests."""
    records, cpu = run(model_dir, params, priorities, requests, duration_s)
    t0 = min(r.start for r in records)
    window = (t0 + warmup_s, t0 + duration_s)
    return {"priorities": priorities,
            "high_class": class_summary([r for r in records if r.client < high_clients], window),
            "others": class_summary([r for r in records if r.client >= high_clients], window),
            "all": class_summary(records, window), "window_s": [warmup_s, duration_s],
            "errors_in_window": sum(1 for r in records if not r.ok and window[0] <= r.end <= window[1]), "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, num_requests=2000, prompt_mean=512, gen_mean=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--high-clients", type=int, default=4)
    ap.add_argument("--high-priority", type=int, default=10)
    ap.add_argument("--duration", type=float, default=75.0, help="seconds each run lasts")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds at the start of each run not measured")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine or server parameter (defaults here: token_budget=256, "
                         "enable_prefix_caching=false, stream_interval=1, num_threads=1)")
    ap.add_argument("--name", default="priority")
    args = ap.parse_args()
    ensure_model(args.model_dir, "bench")
    params = {"token_budget": "256", "enable_prefix_caching": "false", "stream_interval": "1", "num_threads": "1",
              **name_values(args.param)}
    requests = random_id_requests(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.seed)
    high = [args.high_priority] * args.high_clients
    runs = {}
    # The baseline first, then the same clients with the first --high-clients sending the priority.
    with_priority = high + [0] * (args.clients - args.high_clients)
    for name, priorities in (("without", [0] * args.clients), ("with", with_priority)):
        runs[name] = measure(args.model_dir, params, priorities, args.high_clients, requests, args.duration,
                             args.warmup)
        print(name, json.dumps({k: runs[name][k] for k in ("high_class", "others")}), flush=True)
    result = {"runs": runs, "params": params, "clients": args.clients, "high_clients": args.high_clients,
              "high_priority": args.high_priority}
    write_result(RESULTS, args.name, result)


if __name__ == "__main__":
    main()
