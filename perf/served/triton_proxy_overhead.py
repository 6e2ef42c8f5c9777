"""The OpenAI front's Triton proxy (--triton-proxy): latency of tritonclient.http calls made
directly to Triton's loopback HTTP port vs. through the front's port (with the API key).

    .venv/bin/python perf/served/triton_proxy_overhead.py --model DIR [--n 50]

Starts the launcher (one llm replica, the test engine settings), then for each workload runs
`--warmup` calls, and `--n` calls alternating direct / proxied (so a load change on a shared
machine hits both alike); writes results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from splitfuse.launcher import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common import paths  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402

KEY = "perf-" + os.urandom(8).hex()
BEARER = {"Authorization": f"Bearer {KEY}"}
ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": "256", "token_budget": "256", "num_threads": "1"}


def start(model: str, ports: dict[str, int]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitfuse.launcher", "--model", model, "--instances", "1", "--triton-proxy",
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--metrics-port",
           str(ports["metrics"]), "--openai-port", str(ports["openai"]),
           *(f"--param={k}={v}" for k, v in ENGINE.items())]
    proc = subprocess.Popen(cmd, env=dict(os.environ, SPLITFUSE_API_KEY=KEY), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("splitfuse.launcher: ready"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600):
        proc.kill()
        raise SystemExit("the launcher did not get ready")
    return proc


def infer_call(client, headers):
    t = httpclient.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[b"The quick brown fox jumps over the lazy dog"]], dtype=np.object_))
    return lambda: client.infer("preprocessing", [t], headers=headers).as_numpy("input_ids")


def generate_call(url, headers):
    body = json.dumps({"text_input": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()

    def call():
        req = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", data=body,
                                     headers={"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["text_output"]
    return call


def stream_first_event_call(url, headers):
    body = json.dumps({"text_input": "hello", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()

    def call():
        req = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate_stream", data=body,
                                     headers={"Content-Type": "application/json", **headers})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as r:
            first = None
            for line in r:
                if line.startswith(b"data:") and first is None:
                    first = time.perf_counter() - start
            return first
    return call


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "min_ms": round(ms[0], 3)}


def run(direct, proxied, n: int, warmup: int, first_event: bool = False) -> dict:
    for _ in range(warmup):
        direct(), proxied()
    times = {"direct": [], "proxied": []}
    for _ in range(n):
        for name, call in (("direct", direct), ("proxied", proxied)):
            t0 = time.perf_counter()
            value = call()
            times[name].append(1000 * (value if first_event else time.perf_counter() - t0))
    out = {k: summary(v) for k, v in times.items()}
    out["overhead_median_ms"] = round(out["proxied"]["median_ms"] - out["direct"]["median_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=str(paths.RESULTS / "2026-11-29-triton-proxy" / "results.json"))
    a = ap.parse_args()
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    meta = {"machine": {**machine_info(), "loadavg_before": os.getloadavg()},
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "engine": ENGINE,
            "model": a.model, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    proc = start(a.model, ports)
    try:
        d_url, p_url = f"127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['openai']}"
        d_client, p_client = httpclient.InferenceServerClient(d_url), httpclient.InferenceServerClient(p_url)
        results = {
            "preprocessing_infer": run(infer_call(d_client, None), infer_call(p_client, BEARER), a.n, a.warmup),
            "ensemble_generate_8_tokens": run(generate_call(d_url, {}), generate_call(p_url, BEARER), a.n, a.warmup),
            "generate_stream_first_event": run(stream_first_event_call(d_url, {}),
                                               stream_first_event_call(p_url, BEARER), a.n, a.warmup,
                                               first_event=True),
        }
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    meta["machine"]["loadavg_after"] = os.getloadavg()
    Path(a.out).write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    print(f"| workload | direct median (p90) ms | through the front median (p90) ms | overhead (median) ms |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['direct']['median_ms']} ({r['direct']['p90_ms']}) | {r['proxied']['median_ms']} "
              f"({r['proxied']['p90_ms']}) | {r['overhead_median_ms']} |")


if __name__ == "__main__":
    main()
