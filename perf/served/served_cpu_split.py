"""Where a served run's CPU goes: the engine threads against the serving path, per request and token.

    .venv/bin/python perf/served/served_cpu_split.py --clients 64 --per-client 8 --name bench-64
    .venv/bin/python perf/served/served_cpu_split.py --model-dir perf/.cache/medium-llama --model-size medium \\
        --clients 64 --per-client 3 --param kv_cache_memory_gb=2 --name medium-64

Starts our server (`--instances` bf16 replicas by default, as `splitfuse_r2@256:bf16` in
run_all.py), runs one closed-loop point of the FastGen workload over Triton's HTTP
generate_stream (the run_all.py client, in this process), and reads every thread's CPU time from
/proc once a second. Over the middle of the point (`--settle` seconds cut from each end, where
clients ramp up and drain) it reports the cores used by:
- the engine threads: in each replica's engine process (engine_process=true, the default), or
  in each `llm` stub where the engine runs in the stub, its busiest thread (the thread that steps
  the engine and runs the kernels);
- the serving path: the engine processes' other threads (outputs onto the pipe), the `llm` stubs'
  other threads (responses, cancellation, metrics), the `preprocessing` stub, tritonserver itself
  (HTTP, the ensemble, the Python backend's side of each response); and the client;
and the serving path's CPU per request, per streamed token and per streamed response (the rates
are the point's; responses count those that carried tokens).
Written to perf/results/2026-11-26-cpu-split/<name>.json with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import CACHE  # noqa: E402
from perf.common import paths  # noqa: E402
from perf.served.closed_loop import cpu_seconds, proc_tree, sweep  # noqa: E402
from perf.served.drivers import TritonHttpDriver  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402
from perf.common.workload import SERVED_MAX_MODEL_LEN, VARIANCE, ensure_model, make_workload  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-26-cpu-split"
DEFAULT_PARAMS = {"dtype": "bfloat16", "token_budget": "256", "enable_prefix_caching": "false", "num_threads": "1"}
SERVING_ROLES = ("llm stubs, other threads", "engine processes, other threads", "preprocessing stub", "tritonserver")


def _role(pid: int, server_pid: int, own_pid: int) -> str | None:
    if pid == own_pid:
        return "client"
    if pid == server_pid:
        return "tritonserver"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if "/llm/1/model.py" in cmd:
        return "llm stub"
    if "splitfuse.engine.core_process" in cmd:  # a replica's engine, in its own process (engine_process)
        return "engine process"
    if "/preprocessing/1/model.py" in cmd:
        return "preprocessing stub"
    return "other server processes"


def thread_cpu(server_pid: int) -> dict[tuple[str, int, int], float]:
    """CPU seconds of every thread of the server's process tree and of this process, keyed by
    (role, pid, tid)."""
    own = os.getpid()
    out: dict[tuple[str, int, int], float] = {}
    for pid in proc_tree([server_pid]) | {own}:
        role = _role(pid, server_pid, own)
        if role is None:
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            cpu = cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
            if cpu is not None:
                out[(role, pid, tid)] = cpu
    return out


def split(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores by role between two snapshots. The engine thread is the busiest thread of each engine
    process, or of each llm stub where the engine runs in the stub (engine_process=false); the
    other threads of either are the serving path (responses, cancellation, metrics, the pipe)."""
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    in_stub = not any(role == "engine process" for role, _pid, _tid in used)
    cores: dict[str, float] = {}
    engines: dict[tuple[str, int], list[float]] = {}
    for (role, pid, _tid), cpu in used.items():
        if role == "engine process" or (role == "llm stub" and in_stub):
            engines.setdefault((role, pid), []).append(cpu)
        else:
            name = "llm stubs, other threads" if role == "llm stub" else role
            cores[name] = cores.get(name, 0.0) + cpu / seconds
    for (role, _pid), threads in engines.items():
        threads.sort(reverse=True)
        rest = "llm stubs, other threads" if role == "llm stub" else "engine processes, other threads"
        cores["engine threads"] = cores.get("engine threads", 0.0) + threads[0] / seconds
        cores[rest] = cores.get(rest, 0.0) + sum(threads[1:]) / seconds
    return cores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(CACHE / "bench-llama"))
    ap.add_argument("--model-size", default="bench", help="demo_model size built when --model-dir is missing")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=8)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help=f"engine parameter (defaults: {DEFAULT_PARAMS})")
    ap.add_argument("--prompt-mean", type=float, default=512)
    ap.add_argument("--gen-mean", type=float, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--triton-model", default="ensemble", choices=("ensemble", "llm"),
                    help="the model the clients call: the ensemble (tokenized by the preprocessing model) "
                         "or llm with the prompt's text (tokenized in the llm stub)")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds cut from each end of the point")
    ap.add_argument("--name", required=True)
    args = ap.parse_args()

    from splitfuse.launcher import serve

    ensure_model(args.model_dir, args.model_size)
    params = dict(DEFAULT_PARAMS)
    params.update(p.split("=", 1) for p in args.param)
    n = args.clients * args.per_client
    specs = make_workload(args.model_dir, n, args.prompt_mean, args.gen_mean, VARIANCE, args.seed, SERVED_MAX_MODEL_LEN)
    with serve(args.model_dir, params, instances=args.instances, ready_timeout_s=600) as srv:
        driver = TritonHttpDriver(srv.http_url, args.triton_model)
        samples: list[tuple[float, dict]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), thread_cpu(srv.process.pid)))
                stop.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        res = sweep(driver, specs, [args.clients], per_client=args.per_client, min_requests=n, max_requests=n)
        stop.set()
        sampler.join()
    point = res["points"][0]
    m = point["metrics"]
    t0, t1 = samples[0][0] + args.settle, samples[-1][0] - args.settle
    window = [s for s in samples if t0 <= s[0] <= t1]
    if len(window) < 2:
        sys.exit(f"the point ran {samples[-1][0] - samples[0][0]:.0f} s: too short for --settle {args.settle}; "
                 "raise --per-client")
    seconds = window[-1][0] - window[0][0]
    cores = split(window[0][1], window[-1][1], seconds)
    rps = m["throughput_rps"]
    tokens_per_s = m["output_tokens_per_s"]
    serving = sum(cores.get(r, 0.0) for r in SERVING_ROLES)
    # Streamed responses that carried tokens, per completed request: what the serving path
    # handles one at a time (stream_interval and its time bound set how many a request gets).
    done = [r for r in point["records"] if r.get("error") is None]
    responses = sum(len(r["chunks"]) for r in done) / max(1, len(done))
    out = {
        "name": args.name, "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
        "model_dir": args.model_dir, "triton_model": args.triton_model, "params": params, "instances": args.instances, "clients": args.clients,
        "requests": n, "throughput_rps": rps, "output_tokens_per_s": tokens_per_s, "window_s": seconds,
        "cores": cores, "serving_path_cores": serving,
        "serving_path_cpu_ms_per_request": 1000 * serving / rps,
        "serving_path_cpu_us_per_token": 1e6 * serving / tokens_per_s,
        "responses_per_request": responses,
        "serving_path_cpu_us_per_response": 1e6 * serving / (rps * responses),
        "engine_cpu_ms_per_request": 1000 * cores.get("engine threads", 0.0) / rps,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{rps:.3f} req/s over {n} requests; cores over the middle {seconds:.0f} s:")
    for role, c in sorted(cores.items(), key=lambda kv: -kv[1]):
        print(f"  {role:28s} {c:5.2f}")
    print(f"  serving path: {serving:.2f} cores, {out['serving_path_cpu_ms_per_request']:.1f} ms of CPU per request"
          f", {out['serving_path_cpu_us_per_token']:.0f} us per streamed token; {responses:.1f} responses per request"
          f", {out['serving_path_cpu_us_per_response']:.0f} us each")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
