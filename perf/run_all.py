#!/usr/bin/env python
"""Side-by-side FastGen-style comparison on this machine, with plots and a markdown summary.

For each system in turn (one server at a time, so they never share the CPU):
  * splitfuse / prefill_first / orca [@TOKEN_BUDGET]: our Triton server (`splitfuse.server.serve`)
    with that `scheduler_policy` (and token budget; everything else identical), driven through
    the `ensemble` model over tritonclient gRPC streaming;
  * vllm / vllm_2c: vLLM's CPU build (perf/.venv-vllm) serving the same checkpoint through its
    OpenAI-compatible server on loopback, driven with streaming /v1/completions (vllm: its own
    CPU thread binding, vllm_2c: compute threads on both cores).
Every system gets the same drawn request list, the same client counts and request counts.

    .venv/bin/python perf/run_all.py                       # full comparison (~25 min here)
    .venv/bin/python perf/run_all.py --systems splitfuse,prefill_first --clients 1,4
    .venv/bin/python perf/run_all.py --report-only         # plots + summary from raw/

Outputs under --out (default perf/results/fastgen/): raw/<system>.json.gz (every request's token
arrival times) and raw/meta.json, metrics.csv, throughput_latency.png, effective_throughput.png,
token_latency.png, summary.md.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import fastgen_bench as fb  # noqa: E402
from machine import cpu_model  # noqa: E402
from machine import cpu_flags  # noqa: E402
from machine import mem_gib as total_mem_gib  # noqa: E402

TRITON_POLICIES = ("splitfuse", "prefill_first", "orca")
SYSTEM_ORDER = ("splitfuse", "prefill_first", "orca", "vllm", "vllm_2c")
VLLM_SYSTEMS = {
    # vLLM's own CPU defaults: on 2 cores it binds its OpenMP threads to core 0 and keeps core 1
    # for the API server (VLLM_CPU_OMP_THREADS_BIND=auto).
    "vllm": {},
    # Both cores for vLLM's compute threads, as our engine's torch threads use them.
    "vllm_2c": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
}
LABELS = {
    "splitfuse": "SplitFuse (ours)",
    "prefill_first": "prefill_first (ours, vLLM-v0 style)",
    "orca": "orca (ours)",
    "vllm": "vLLM-CPU 0.32.0",
    "vllm_2c": "vLLM-CPU 0.32.0 (2 compute cores)",
}
COLORS = {"splitfuse": "tab:blue", "prefill_first": "tab:orange", "orca": "tab:green", "vllm": "tab:red",
          "vllm_2c": "tab:purple"}
# Supplementary first-token SLA: prompt_tokens / 128 s. The blog's 512 tokens/s is a small share
# of a GPU's prefill rate; our engine prefills ~1000 tokens/s on 2 CPU cores, so under the blog's
# SLA a prompt may share the CPU with at most one other before it misses its deadline.
RELAXED_PROMPT_TPS = 128.0
MARKERS = {"splitfuse": "o", "prefill_first": "x", "orca": "s", "vllm": "^", "vllm_2c": "v"}


# A system is a base name, optionally with a token budget for our engine: "prefill_first@2048".
def base_of(system: str) -> str:
    return system.split("@", 1)[0]


def budget_of(system: str) -> int | None:
    return int(system.split("@", 1)[1]) if "@" in system else None


def label_of(system: str) -> str:
    b = budget_of(system)
    return LABELS[base_of(system)] + (f", budget {b}" if b else "")


def color_of(system: str) -> str:
    return COLORS[base_of(system)]


def marker_of(system: str) -> str:
    return MARKERS[base_of(system)]


def order_key(system: str) -> tuple:
    return (SYSTEM_ORDER.index(base_of(system)), budget_of(system) or 0)


def file_stem(system: str) -> str:
    return system.replace("@", "_b")


def log(msg: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    cpu = cpu_model()
    mem_gib = total_mem_gib()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        if dirty:
            commit += " (+ uncommitted changes)"
    except OSError:
        commit = "unknown"
    # The serving code may not be committed yet: a digest of what was measured identifies it.
    digest = hashlib.sha256()
    files = 0
    for pattern in ("backend/**/*.py", "kernels/**/*.py", "model_repository/**/*"):
        for f in sorted(ROOT.glob(pattern)):
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
                files += 1
    versions = {}
    from importlib import metadata

    for dist in ("torch", "transformers", "tritonclient", "nvidia-pytriton"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "?"
    return {
        "cpu": cpu,
        "cpu_flags": " ".join(cpu_flags()),
        "cores": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "git_commit": commit or "unknown",
        "source_digest": f"sha256:{digest.hexdigest()[:16]} over {files} files of backend/, kernels/, model_repository/",
        "versions": versions,
    }


def model_info(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                               cfg["vocab_size"])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter + 2 * h
    params = layers * per_layer + 2 * vocab * h + h  # embeddings + untied lm_head + final norm
    demo = {}
    if (Path(model_dir) / "splitfuse_demo.json").is_file():
        demo = json.loads((Path(model_dir) / "splitfuse_demo.json").read_text())
    return {
        "path": str(model_dir),
        "arch": cfg.get("model_type"),
        "params_m": round(params / 1e6, 1),
        "hidden": h,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "intermediate": inter,
        "vocab": vocab,
        "dtype": cfg.get("dtype", cfg.get("torch_dtype")),
        "built_by": demo,
    }


def ensure_model(model_dir: str, size: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        log(f"building the {size} checkpoint in {model_dir}")
        subprocess.run([sys.executable, "-m", "splitfuse.demo_model", model_dir, "--arch", "llama",
                        "--size", size], check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ systems
def run_triton(system: str, args, specs, clients) -> dict:
    """One server per system; if tritonserver dies during a point, it is restarted and that point
    is measured again (up to --max-restarts times per system; the summary reports restarts)."""
    from splitfuse.server import serve

    policy = base_of(system)
    params = {"scheduler_policy": policy, "token_budget": str(budget_of(system) or args.token_budget)}
    for item in args.param:
        k, _, v = item.partition("=")
        params[k] = v
    workdir = (Path(args.workdir) / file_stem(system)).resolve()
    points: list[dict] = []
    crashes: list[dict] = []
    offset = 0
    i = 0
    load_before = os.getloadavg()
    t_sweep = time.time()
    while i < len(clients):
        log(f"{system}: starting tritonserver ({params})")
        t0 = time.time()
        try:
            with serve(args.model_dir, params, workdir=workdir, ready_timeout_s=600) as srv:
                log(f"{system}: ready in {time.time() - t0:.0f}s at {srv.grpc_url}")
                driver = fb.TritonDriver(srv.grpc_url, args.triton_model)
                warmup = args.warmup
                while i < len(clients):
                    c = clients[i]
                    res = fb.sweep(driver, specs, [c], per_client=args.per_client, min_requests=args.min_requests,
                                   max_requests=args.max_requests, time_limit_s=args.point_time_limit,
                                   request_timeout_s=args.request_timeout, warmup=warmup, log=log,
                                   server_pids=lambda: [srv.process.pid], start_offset=offset)
                    warmup = 0
                    point = res["points"][0]
                    if point["metrics"]["errors"] and srv.process.poll() is None:
                        # A dying tritonserver may still be running for a moment after it failed
                        # the requests; give it time, then check it still answers.
                        for _ in range(20):
                            if srv.process.poll() is not None:
                                break
                            time.sleep(0.5)
                        if srv.process.poll() is None and not srv.is_ready():
                            srv.process.kill()
                            srv.process.wait()
                    if srv.process.poll() is not None:
                        crashes.append({"clients": c, "code": srv.process.returncode})
                        log(f"{system}: tritonserver exited during the {c}-client point (code "
                            f"{srv.process.returncode}); see {workdir / 'server.log'}")
                        if len(crashes) <= args.max_restarts:
                            break  # restart the server and measure this point again
                        point["server_crashed"] = srv.process.returncode
                    points.append(point)
                    offset += point["requests"]
                    i += 1
        finally:
            _reap_leftovers(workdir)
    return {"points": points, "wall_s": time.time() - t_sweep, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "server_exits": crashes,
            "server": {"kind": "triton", "model": args.triton_model, "params": params}}


def _reap_leftovers(workdir: Path) -> None:
    """Stop processes left running from `workdir` (Python-backend stubs outlive a tritonserver
    that crashed). Matched by the work directory's path in their command line, ended by pid."""
    mark = str(Path(workdir).resolve())
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mark in cmd:
            log(f"stopping leftover process {d.name}: {cmd[:100]}")
            try:
                os.kill(int(d.name), signal.SIGTERM)
                time.sleep(2)
                os.kill(int(d.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_vllm(system: str, args, specs, clients) -> dict:
    port = _free_port()
    py = Path(args.vllm_python)
    if not py.exists():
        raise FileNotFoundError(f"{py} not found: install vLLM-CPU first (see perf/README.md)")
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(args.model_dir).resolve()),
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--no-enable-prefix-caching", "--disable-log-stats", *args.vllm_arg]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    env.pop("VIRTUAL_ENV", None)
    env.update(VLLM_SYSTEMS[system])
    for item in args.vllm_env:
        k, _, v = item.partition("=")
        env[k] = v
    log_path = Path(args.workdir) / system / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"{system}: starting {' '.join(cmd[1:])}")
    t0 = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=str(ROOT))
    try:
        deadline = time.time() + args.vllm_ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vLLM not ready after {args.vllm_ready_timeout}s; see {log_path}")
            time.sleep(1)
        log(f"{system}: ready in {time.time() - t0:.0f}s on port {port}")
        driver = fb.OpenAIDriver(f"http://127.0.0.1:{port}", "bench")
        res = _sweep(driver, specs, clients, args, lambda: [proc.pid])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    res["server"] = {"kind": "openai", "cmd": cmd[1:], "env": {k: env[k] for k in env if k.startswith("VLLM_")}}
    return res


def _sweep(driver, specs, clients, args, server_pids) -> dict:
    load_before = os.getloadavg()
    t = time.time()
    res = fb.sweep(driver, specs, clients, per_client=args.per_client, min_requests=args.min_requests,
                   max_requests=args.max_requests, time_limit_s=args.point_time_limit,
                   request_timeout_s=args.request_timeout, warmup=args.warmup, log=log, server_pids=server_pids)
    res["wall_s"] = time.time() - t
    res["loadavg_before"] = load_before
    res["loadavg_after"] = os.getloadavg()
    return res


# ------------------------------------------------------------------------------------ report
def save_raw(path: Path, doc: dict) -> None:
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)


def load_results(raw_dir: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(raw_dir.iterdir()):
        if f.name == "meta.json" or not (f.name.endswith(".json") or f.name.endswith(".json.gz")):
            continue
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            doc = json.load(fh)
        name = doc.get("system") or f.name.split(".")[0]
        out[name] = doc
    return dict(sorted(out.items(), key=lambda kv: order_key(kv[0])))


def metrics_table(results: dict[str, dict], relaxed_prompt_tps: float | None = None) -> list[dict]:
    rows = []
    for name, doc in results.items():
        for p in doc["points"]:
            recs = [fb.RequestRecord.from_json(r) for r in p["records"]]
            m = fb.summarize(recs)
            if relaxed_prompt_tps:
                relaxed = fb.summarize(recs, prompt_tps=relaxed_prompt_tps)
                for k, v in relaxed.items():
                    if k.startswith(("effective_rps@", "sla_ok_frac@")):
                        m["relaxed_" + k] = v
            cpu = p.get("cpu") or {}
            rows.append({"system": name, "clients": p["clients"], **m,
                         "foreign_cores_busy": cpu.get("foreign_cores_busy"),
                         "ours_cores_busy": cpu.get("ours_cores_busy")})
    return rows


def _fmt(v, nd=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def _client_axis(ax, clients) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(clients))
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("Clients")


def make_plots(rows: list[dict], out: Path, token_clients: int, meta: dict,
               relaxed_prompt_tps: float | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r["system"] for r in rows}, key=order_key)
    by = {s: sorted([r for r in rows if r["system"] == s and r.get("completed")], key=lambda r: r["clients"])
          for s in systems}
    wl = meta.get("workload", {})
    subtitle = (f"{meta.get('model', {}).get('params_m', '?')}M-param Llama (random weights), CPU "
                f"{meta.get('machine', {}).get('cores', '?')} cores; prompt ~N({wl.get('prompt_mean')}, 30%), "
                f"generation ~N({wl.get('gen_mean')}, 30%)")
    files = []

    # 1. Throughput vs latency (FastGen Fig. 2/3)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        xs = [r["throughput_rps"] for r in by[s]]
        ys = [r["mean_latency_s"] for r in by[s]]
        ax.plot(xs, ys, marker=marker_of(s), color=color_of(s), label=label_of(s),
                    linestyle=_style(systems, s))
        for r in by[s]:
            ax.annotate(str(r["clients"]), (r["throughput_rps"], r["mean_latency_s"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3), color=color_of(s))
    ax.set_xlabel("Throughput (requests/s)")
    ax.set_ylabel("Mean end-to-end latency (s)")
    ax.set_title("Throughput vs latency (labels: clients)\n" + subtitle, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "throughput_latency.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(f.name)

    # 2. Effective throughput vs clients (FastGen Fig. 4), one panel per generation SLA; and the
    #    same with the relaxed first-token SLA when it was computed.
    variants = [("", fb.SLA_PROMPT_TOKENS_PER_S, "effective_throughput.png")]
    if relaxed_prompt_tps:
        variants.append(("relaxed_", relaxed_prompt_tps, "effective_throughput_relaxed.png"))
    for prefix, prompt_tps, fname in variants:
        rates = fb.SLA_GEN_RATES
        fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4), sharey=True)
        for ax, rate in zip(axes, rates):
            for s in systems:
                ax.plot([r["clients"] for r in by[s]], [r.get(f"{prefix}effective_rps@{rate:g}", 0.0) for r in by[s]],
                        marker=marker_of(s), color=color_of(s), label=label_of(s), linestyle=_style(systems, s))
            _client_axis(ax, [r["clients"] for s in systems for r in by[s]])
            ax.set_title(f"SLA: prompt {prompt_tps:g} tok/s, generation {rate:g} tok/s", fontsize=9)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("Effective throughput (requests/s)")
        axes[0].legend(fontsize=7)
        what = "FastGen SLA" if not prefix else f"first-token SLA relaxed to prompt/{prompt_tps:g} s"
        fig.suptitle(f"Effective throughput ({what})  -  " + subtitle, fontsize=9)
        fig.tight_layout()
        f = out / fname
        fig.savefig(f, dpi=120)
        plt.close(fig)
        files.append(f.name)

    # 3. Token latency percentiles (FastGen Fig. 5) at one client count, and P95 vs clients
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        pt = next((r for r in by[s] if r["clients"] == token_clients), None)
        if pt is None:
            continue
        vals = [pt["token_latency_p50_s"] * 1e3, pt["token_latency_p90_s"] * 1e3, pt["token_latency_p95_s"] * 1e3]
        xs = [j + i * width for j in range(3)]
        bars = ax1.bar(xs, vals, width, color=color_of(s), label=label_of(s), hatch=_hatch(systems, s),
                       edgecolor="white" if _hatch(systems, s) else None)
        for b, v in zip(bars, vals):
            ax1.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6,
                         rotation=90)
    ax1.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(3)], ["P50", "P90", "P95"])
    ax1.set_ylabel("Per-token generation latency (ms)")
    ax1.set_title(f"Token latency, {token_clients} clients", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(True, axis="y", alpha=0.3)
    for s in systems:
        ax2.plot([r["clients"] for r in by[s]], [r["token_latency_p95_s"] * 1e3 for r in by[s]],
                 marker=marker_of(s), color=color_of(s), label=label_of(s),
                    linestyle=_style(systems, s))
    _client_axis(ax2, [r["clients"] for s in systems for r in by[s]])
    ax2.set_yscale("log")
    ax2.set_ylabel("P95 per-token latency (ms)")
    ax2.set_title("P95 token latency vs clients", fontsize=9)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    f = out / "token_latency.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(f.name)
    return files


def _family(systems, s):
    return [x for x in systems if base_of(x) == base_of(s)]


def _variants(systems, s) -> bool:
    return len(_family(systems, s)) > 1


def _variant_index(systems, s) -> int:
    return sorted(_family(systems, s), key=order_key).index(s)


def _style(systems, s) -> str:
    return ["-", "--", ":", "-."][_variant_index(systems, s) % 4]


def _hatch(systems, s) -> str | None:
    return [None, "//", "..", "xx"][_variant_index(systems, s) % 4]


def _server_desc(server: dict) -> str:
    if server.get("kind") == "triton":
        return (f"python -m splitfuse.server (model {server.get('model')}) "
                + " ".join(f"--param {k}={v}" for k, v in server.get("params", {}).items()))
    if server.get("kind") == "openai":
        env = " ".join(f"{k}={v}" for k, v in server.get("env", {}).items())
        cmd = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(server.get("cmd", [])))
        return f"{env} python {cmd}".strip()
    return json.dumps(server)


def _ratio(a, b):
    if a is None or b is None or b != b or a != a:
        return None
    if b == 0:
        return float("inf") if a > 0 else None
    return a / b


def headline(rows: list[dict], token_clients: int, prefix: str = "") -> dict:
    systems = sorted({r["system"] for r in rows}, key=order_key)
    best = {}
    for s in systems:
        pts = [r for r in rows if r["system"] == s and r.get("completed")]
        best[s] = {}
        for rate in fb.SLA_GEN_RATES:
            key = f"{prefix}effective_rps@{rate:g}"
            top = max(pts, key=lambda r: r.get(key, 0.0), default=None)
            best[s][f"{rate:g}"] = (top.get(key, 0.0), top["clients"]) if top else (None, None)
        pt = next((r for r in pts if r["clients"] == token_clients), None)
        best[s]["p95_token_s"] = pt["token_latency_p95_s"] if pt else None
        best[s]["max_throughput"] = max((r["throughput_rps"] for r in pts), default=None)
        single = next((r for r in pts if r["clients"] == 1), None)
        best[s]["p50_token_1client_s"] = single.get("token_latency_p50_s") if single else None
    return best


def write_summary(out: Path, rows: list[dict], meta: dict, plots: list[str], token_clients: int,
                  relaxed_prompt_tps: float | None = None, headline_system: str | None = None) -> Path:
    mach, model, wl = meta["machine"], meta["model"], meta["workload"]
    best = headline(rows, token_clients)
    lines = []
    lines.append("# FastGen-style serving benchmark: SplitFuse vs prefill_first vs orca vs vLLM-CPU\n")
    cmds = meta.get("commands") or [meta.get("command", "perf/run_all.py")]
    lines.append("Generated by " + ", then ".join(f"`{c}`" for c in cmds) +
                 f" (last run {meta.get('date', '?')}); each system's start time and measured code are in the "
                 "run notes.\n")
    lines.append("## Setup\n")
    lines.append(f"- **Machine**: {mach['cpu']} (flags: {mach.get('cpu_flags', '?')}), {mach['cores']} cores, "
                 f"{mach['ram_gib']} GiB RAM, {mach['os']}, "
                 f"Python {mach['python']}, torch {mach['versions'].get('torch')}, tritonserver 2.51.0 from nvidia-pytriton "
                 f"{mach['versions'].get('nvidia-pytriton')}, tritonclient {mach['versions'].get('tritonclient')}; no GPU. The client runs on the "
                 "same cores as the server. Load average before/after each system is listed below.")
    ours = {info.get("source_digest") for s_, info in meta.get("runs", {}).items() if base_of(s_) in TRITON_POLICIES}
    same = (" (every one of our systems ran this code)" if ours == {mach.get("source_digest")}
            else " (our systems did not all run the same code: see the run notes)" if ours else "")
    lines.append(f"- **Git commit**: `{mach['git_commit']}`; code measured: `{mach.get('source_digest', '?')}`{same}")
    lines.append(f"- **Model**: `{model['path']}`: random-weight {model['arch']} ({model['params_m']}M params, "
                 f"hidden {model['hidden']}, {model['layers']} layers, {model['heads']} heads / {model['kv_heads']} KV "
                 f"heads, vocab {model['vocab']}, {model['dtype']}), built by "
                 f"`python -m splitfuse.demo_model DIR --size {model.get('built_by', {}).get('size', '?')}`.")
    lines.append(f"- **Workload**: prompt tokens ~ Normal({wl['prompt_mean']:g}, sd {wl['variance'] * 100:g}% of mean), "
                 f"generated tokens ~ Normal({wl['gen_mean']:g}, sd {wl['variance'] * 100:g}%), exactly that many "
                 f"generated (ignore_eos / min_tokens), greedy; {wl['num_requests']} requests drawn with seed "
                 f"{wl['seed']} (measured prompt mean {wl.get('measured_prompt_mean', float('nan')):.0f}, "
                 f"generation mean {wl.get('measured_gen_mean', float('nan')):.0f}). The blog used prompt means "
                 f"1200/2600 and generation 60/128 on GPUs; here the prompt mean is scaled by "
                 f"{wl['prompt_mean'] / 2600:.2f}x of 2600 ({wl['prompt_mean'] / 1200:.2f}x of 1200) and generation "
                 f"by {wl['gen_mean'] / 128:.2f}x of 128 to fit a 2-core CPU.")
    lines.append(f"- **Load**: closed-loop clients {', '.join(str(c) for c in meta['clients'])}; at each point "
                 f"max({meta['min_requests']}, {meta['per_client']} x clients) requests, every system the same "
                 f"request sequence. Client counts run in order, servers one at a time.")
    lines.append(f"- **SLA** (FastGen): first token within prompt_tokens / {fb.SLA_PROMPT_TOKENS_PER_S:g} s, and the "
                 f"EMA (span {fb.EMA_SPAN}) of inter-token gaps below 1/R s for R = 2, 4, 6 tokens/s. Effective "
                 "throughput = throughput x share of requests meeting both.")
    lines.append("- **Token latency**: gaps between consecutive streamed tokens (first token excluded), "
                 "P50/P90/P95 over all requests of a point.")
    lines.append("- **Servers**:")
    for s in sorted(meta["servers"], key=order_key):
        lines.append(f"  - {label_of(s)}: `{_server_desc(meta['servers'][s])}`")
    lines.append("")
    lines.append("## Headline\n")
    lines.append("Best effective throughput over the client counts (the blog's 'optimal serving point'), "
                 f"and P95 per-token latency at {token_clients} clients:\n")
    hdr = "| system | max throughput (req/s) | eff. thr. @2 tok/s | eff. thr. @4 tok/s | eff. thr. @6 tok/s | " \
          f"P95 token latency @{token_clients} clients |"
    lines.append(hdr)
    lines.append("|---|---|---|---|---|---|")
    for s in sorted(best, key=order_key):
        b = best[s]
        cells = [f"{_fmt(b[f'{r:g}'][0])} ({b[f'{r:g}'][1]} cl.)" for r in fb.SLA_GEN_RATES]
        p95 = b["p95_token_s"]
        lines.append(f"| {label_of(s)} | {_fmt(b['max_throughput'])} | " + " | ".join(cells) +
                     f" | {_fmt(p95 * 1e3 if p95 is not None else None, 0)} ms |")
    lines.append("")
    sf_name = headline_system if headline_system in best else next(
        (x for x in sorted(best, key=order_key) if base_of(x) == "splitfuse"), None)
    if sf_name is not None:
        lines.append("### Against the targets\n")
        lines.append("| comparison | measured | target | met |")
        lines.append("|---|---|---|---|")
        sf = best[sf_name]
        # vLLM: the CPU fast-path issue's targets (1.5x its effective and raw throughput, single-stream
        # inter-token latency p50 no worse); prefill_first: the FastGen blog's.
        targets = {"prefill_first": (1.5, 0.5), "vllm": (1.5, 1.0), "vllm_2c": (1.5, 1.0), "orca": (None, None),
                   "splitfuse": (None, None)}
        for other in sorted(best, key=order_key):
            if other == sf_name:
                continue
            thr_target, lat_target = targets[base_of(other)]
            for r in fb.SLA_GEN_RATES:
                ratio = _ratio(sf[f"{r:g}"][0], best[other][f"{r:g}"][0])
                tgt = f">= {thr_target:g}x" if thr_target else "(info)"
                met = "-" if thr_target is None or ratio is None else ("yes" if ratio >= thr_target else "no")
                lines.append(f"| {sf_name} / {other}: max effective throughput @{r:g} tok/s | "
                             f"{_fmt(ratio, 2)}x | {tgt} | {met} |")
            if base_of(other) in ("vllm", "vllm_2c"):
                ratio = _ratio(sf["max_throughput"], best[other]["max_throughput"])
                met = "-" if ratio is None else ("yes" if ratio >= thr_target else "no")
                lines.append(f"| {sf_name} / {other}: max raw throughput | {_fmt(ratio, 2)}x | >= {thr_target:g}x | {met} |")
                ratio = _ratio(sf["p50_token_1client_s"], best[other]["p50_token_1client_s"])
                met = "-" if ratio is None else ("yes" if ratio <= 1.0 else "no")
                lines.append(f"| {sf_name} / {other}: P50 token latency @1 client | {_fmt(ratio, 2)}x | <= 1x | {met} |")
            ratio = _ratio(sf["p95_token_s"], best[other]["p95_token_s"])
            tgt = f"<= {lat_target:g}x" if lat_target else "(info)"
            met = "-" if lat_target is None or ratio is None else ("yes" if ratio <= lat_target else "no")
            lines.append(f"| {sf_name} / {other}: P95 token latency @{token_clients} clients | {_fmt(ratio, 2)}x | "
                         f"{tgt} | {met} |")
        lines.append("")
    if relaxed_prompt_tps:
        rbest = headline(rows, token_clients, prefix="relaxed_")
        lines.append(f"### Supplementary: first-token SLA relaxed to prompt_tokens / {relaxed_prompt_tps:g} s\n")
        ours = [c["prefill_tps"] for s_, c in single_request_costs(meta.get("_records_by_system", {})).items()
                if base_of(s_) in TRITON_POLICIES]
        sla = fb.SLA_PROMPT_TOKENS_PER_S
        rate = (f"a lone request sees {min(ours):.0f}-{max(ours):.0f} prompt tokens/s from our engine (table "
                f"below), only {min(ours) / sla:.1f}-{max(ours) / sla:.1f}x the blog's {sla:g} tokens/s deadline "
                "rate (a GPU prefills many times faster), so" if ours else "so")
        lines.append(f"Not the blog's SLA. On this CPU {rate} first-token deadlines are missed as soon as a few "
                     "prompts queue. This table keeps the generation SLAs and gives prompts a "
                     f"{sla / relaxed_prompt_tps:g}x longer deadline.\n")
        lines.append("| system | eff. thr. @2 tok/s | eff. thr. @4 tok/s | eff. thr. @6 tok/s |")
        lines.append("|---|---|---|---|")
        for s_ in sorted(rbest, key=order_key):
            cells = [f"{_fmt(rbest[s_][f'{r:g}'][0])} ({rbest[s_][f'{r:g}'][1]} cl.)" for r in fb.SLA_GEN_RATES]
            lines.append(f"| {label_of(s_)} | " + " | ".join(cells) + " |")
        sf_r = next((x for x in sorted(rbest, key=order_key) if base_of(x) == "splitfuse"), None)
        if sf_r is not None:
            lines.append("")
            for other in sorted(rbest, key=order_key):
                if other == sf_r:
                    continue
                ratios = [_fmt(_ratio(rbest[sf_r][f"{r:g}"][0], rbest[other][f"{r:g}"][0]), 2) + "x"
                          for r in fb.SLA_GEN_RATES]
                lines.append(f"- {sf_r} / {other}, relaxed SLA @2/4/6 tok/s: {' / '.join(ratios)}")
        lines.append("")
    costs = single_request_costs(rows_records=meta.get("_records_by_system", {}))
    if costs:
        lines.append("### Single-request costs (1 client)\n")
        lines.append("Prefill rate = sum of prompt tokens / sum of times to first token over the 1-client point "
                     "(includes tokenization and transport); decode step = median inter-token gap.\n")
        lines.append("| system | requests | mean TTFT (s) | prefill rate (tokens/s) | decode step P50 (ms) |")
        lines.append("|---|---|---|---|---|")
        for s_, c in sorted(costs.items(), key=lambda kv: order_key(kv[0])):
            lines.append(f"| {label_of(s_)} | {c['requests']} | {_fmt(c['mean_ttft_s'], 3)} | "
                         f"{_fmt(c['prefill_tps'], 0)} | {_fmt(c['decode_ms'], 1)} |")
        lines.append("")
    lines.append("## Plots\n")
    for p in plots:
        lines.append(f"![{p}]({p})")
    lines.append("")
    lines.append("## All points\n")
    lines.append("| system | clients | done/sent | thr. (req/s) | out tok/s | mean lat. (s) | TTFT P50 (s) | "
                 "TTFT P95 (s) | tok P50 (ms) | tok P90 (ms) | tok P95 (ms) | SLA ok @2/4/6 | eff. thr. @2/4/6 | "
                 "other procs (cores) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (order_key(r["system"]), r["clients"])):
        if not r.get("completed"):
            lines.append(f"| {r['system']} | {r['clients']} | 0/{r['requests']} | all failed ||||||||||")
            continue
        ok = "/".join(f"{r[f'sla_ok_frac@{x:g}']:.2f}" for x in fb.SLA_GEN_RATES)
        eff = "/".join(f"{r[f'effective_rps@{x:g}']:.3f}" for x in fb.SLA_GEN_RATES)
        lines.append(
            f"| {r['system']} | {r['clients']} | {r['completed']}/{r['requests']} | {_fmt(r['throughput_rps'])} | "
            f"{_fmt(r['output_tokens_per_s'], 1)} | {_fmt(r['mean_latency_s'], 2)} | {_fmt(r['p50_ttft_s'], 2)} | "
            f"{_fmt(r['p95_ttft_s'], 2)} | {_fmt(r['token_latency_p50_s'] * 1e3, 0)} | "
            f"{_fmt(r['token_latency_p90_s'] * 1e3, 0)} | {_fmt(r['token_latency_p95_s'] * 1e3, 0)} | {ok} | {eff} | "
            f"{_fmt(r.get('foreign_cores_busy'), 2)} |")
    lines.append("")
    lines.append("'other procs' = CPU cores that processes other than this benchmark's client and the server "
                 "under test kept busy during the point (from /proc): the noise of a shared machine.\n")
    lines.append("## Run notes\n")
    for s in sorted(meta.get("runs", {}), key=order_key):
        info = meta["runs"][s]
        prov = (f"started {info['started']}" + (f", code `{info['source_digest'].split(' ')[0]}`"
                                                   if base_of(s) in TRITON_POLICIES and info.get("source_digest") else "")
                + "; ") if info.get("started") else ""
        lines.append(f"- {s}: {prov}sweep wall time {info.get('wall_s', float('nan')):.0f} s, load average before "
                     f"{_fmt(info.get('loadavg_before', [None])[0], 2)}, after {_fmt(info.get('loadavg_after', [None])[0], 2)}"
                     f", other processes {_fmt(info.get('foreign_cores_mean'), 2)} cores on average"
                     f"; length mismatches {info.get('length_mismatches', 0)}, prompt-count mismatches "
                     f"{info.get('prompt_mismatches', 0)}, multi-token chunks {info.get('multi_token_chunks', 0)}"
                     + (f"; **tritonserver exited {len(info['server_exits'])} time(s) during a point "
                        f"(clients {', '.join(str(x['clients']) for x in info['server_exits'])}; codes "
                        f"{', '.join(str(x['code']) for x in info['server_exits'])}): it was restarted and that "
                        "point measured again**" if info.get("server_exits") else "") + ".")
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    lines.append("")
    f = out / "summary.md"
    f.write_text("\n".join(lines))
    return f


def single_request_costs(rows_records: dict[str, tuple[int, list]]) -> dict:
    """Per system, from its 1-client point (no queueing): the prefill rate seen by a request,
    sum(prompt tokens) / sum(time to first token), and the median inter-token gap."""
    out = {}
    for system, (clients, recs) in rows_records.items():
        pts = [(r.prompt_tokens, fb.ttft(r)) for r in recs if r.ok and fb.ttft(r) is not None]
        gaps = [g for r in recs if r.ok for g in fb.token_gen_times(r)[1:]]
        if not pts:
            continue
        out[system] = {"clients": clients, "requests": len(pts),
                       "prefill_tps": sum(p for p, _ in pts) / sum(t for _, t in pts),
                       "mean_ttft_s": sum(t for _, t in pts) / len(pts),
                       "decode_ms": fb.percentile(gaps, 50) * 1e3}
    return out


def _mean_cpu(doc: dict) -> float | None:
    """Time-weighted mean of the points' foreign CPU use."""
    num = den = 0.0
    for p in doc["points"]:
        cpu = p.get("cpu")
        dur = (p.get("metrics") or {}).get("duration_s")
        if cpu and dur:
            num += cpu["foreign_cores_busy"] * dur
            den += dur
    return num / den if den else None


def write_csv(rows: list[dict], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def report(out: Path, token_clients: int, relaxed_prompt_tps: float | None = RELAXED_PROMPT_TPS,
           headline_system: str | None = None) -> Path:
    results = load_results(out / "raw")
    if not results:
        raise SystemExit(f"no raw results under {out / 'raw'}")
    meta = json.loads((out / "raw" / "meta.json").read_text())
    rows = metrics_table(results, relaxed_prompt_tps)
    meta.setdefault("runs", {})
    for name, doc in results.items():
        recs = [fb.RequestRecord.from_json(r) for p in doc["points"] for r in p["records"]]
        info = meta["runs"].setdefault(name, {})
        info.update(started=doc.get("started"), source_digest=doc.get("source_digest"))
        info.update(wall_s=doc.get("wall_s", float("nan")), loadavg_before=doc.get("loadavg_before"),
                    loadavg_after=doc.get("loadavg_after"),
                    length_mismatches=sum(1 for r in recs if r.ok and r.output_tokens != r.gen_tokens),
                    prompt_mismatches=sum(1 for r in recs if r.ok and r.server_prompt_tokens is not None
                                          and r.server_prompt_tokens != r.prompt_tokens),
                    multi_token_chunks=sum(1 for r in recs for _, n in r.chunks if n > 1),
                    foreign_cores_mean=_mean_cpu(doc), server_exits=doc.get("server_exits") or [])
        meta.setdefault("servers", {})[name] = doc.get("server", {})
    lowest = {}
    for name, doc in results.items():
        p1 = next((p for p in doc["points"] if p["clients"] == 1 and p.get("records")), None)
        if p1:  # with one client there is no queueing: TTFT is the prefill itself
            lowest[name] = (1, [fb.RequestRecord.from_json(r) for r in p1["records"]])
    meta["_records_by_system"] = lowest
    write_csv(rows, out / "metrics.csv")
    plots = make_plots(rows, out, token_clients, meta, relaxed_prompt_tps)
    return write_summary(out, rows, meta, plots, token_clients, relaxed_prompt_tps, headline_system)


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="splitfuse@128,splitfuse@256,splitfuse@512,prefill_first@128,"
                    "prefill_first@2048,orca@2048,vllm,vllm_2c",
                    help="comma list: splitfuse|prefill_first|orca[@TOKEN_BUDGET], vllm, vllm_2c")
    ap.add_argument("--model-dir", default=str(HERE / ".cache" / "bench-llama"))
    ap.add_argument("--model-size", default="bench", help="demo_model size built when --model-dir is missing")
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-mean", type=float, default=512)
    ap.add_argument("--gen-mean", type=float, default=64)
    ap.add_argument("--variance", type=float, default=fb.VARIANCE)
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
    ap.add_argument("--max-restarts", type=int, default=3,
                    help="tritonserver restarts per system when it exits during a point")
    ap.add_argument("--vllm-python", default=str(HERE / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-ready-timeout", type=float, default=600)
    ap.add_argument("--token-clients", type=int, default=16, help="client count of the token-latency bars")
    ap.add_argument("--out", default=str(HERE / "results" / "fastgen"))
    ap.add_argument("--workdir", default=str(HERE / ".cache" / "run"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--headline-system", default=None,
                    help="our system the targets table compares (default: the first splitfuse system)")
    ap.add_argument("--relaxed-prompt-tps", type=float, default=RELAXED_PROMPT_TPS,
                    help="supplementary first-token SLA (tokens/s); 0 to leave it out")
    ap.add_argument("--note", action="append", default=[], help="line added to the summary's run notes")
    args = ap.parse_args(argv)

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
    ensure_model(args.model_dir, args.model_size)
    clients = fb._parse_ints(args.clients)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if base_of(s) not in SYSTEM_ORDER or (budget_of(s) and base_of(s) not in TRITON_POLICIES):
            raise SystemExit(f"unknown system {s!r}; choose from {SYSTEM_ORDER} (ours may take @BUDGET)")
    specs = fb.make_workload(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean, args.variance,
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
        command="perf/run_all.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    meta["commands"] = list(dict.fromkeys(meta.get("commands", []) + [meta["command"]]))
    meta.setdefault("servers", {})
    meta_path.write_text(json.dumps(meta, indent=1))
    for s in systems:
        t = time.time()
        started = time.strftime("%Y-%m-%d %H:%M %Z")
        digest = machine_info()["source_digest"]
        try:
            if base_of(s) in VLLM_SYSTEMS:
                res = run_vllm(s, args, specs, clients)
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
    log(f"wrote {report(out, args.token_clients, args.relaxed_prompt_tps, args.headline_system)}")


if __name__ == "__main__":
    main()
