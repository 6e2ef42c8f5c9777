#!/usr/bin/env python
"""Prefix caching, served: a chat workload with caching on vs off, and vLLM-CPU with its own
prefix caching on, in one run; plus the cost of caching on a workload with no shared prefix.

Chat workload: a few system prompts of ~1,000 tokens, each shared by many conversations; a
conversation is several turns, turn k's prompt = the system prompt + every earlier user message
and the answer the server actually streamed back + the new user message (so later turns repeat
the whole history). Closed-loop clients each take the next conversation and run its turns one
after another; every system gets the same conversations in the same order. Every turn generates
exactly its drawn number of tokens (ignore_eos), greedy.

No-shared-prefix workload: fastgen_bench's prose prompts, each starting with its own request
number so that no two share even their first KV block; caching on and off alternate (on, off,
on, off, ...) to spread the machine's drift over both.

    .venv/bin/python perf/served/prefix_cache_bench.py            # full run (~15 min on 2 idle cores)
    .venv/bin/python perf/served/prefix_cache_bench.py --quick    # a few minutes: smaller everything
    .venv/bin/python perf/served/prefix_cache_bench.py --report-only

Systems: `ours_cache_on` / `ours_cache_off`: our Triton server (`splitfuse.launcher.serve`,
`ensemble` model, gRPC streaming, `enable_prefix_caching` true/false, everything else default
but `token_budget`); `vllm_cache_on`: vLLM-CPU's OpenAI server (perf/.venv-vllm) with
`--enable-prefix-caching`, streaming /v1/completions, with its own CPU binding; `vllm_2c_cache_on`:
the same with both cores computing (VLLM_CPU_OMP_THREADS_BIND=0-1, its faster setting on 2 cores
in perf/served/run_all.py). The targets compare with the better of the vLLM systems run. Per request: TTFT and the prompt tokens
the server found cached (ours: the `num_cached_tokens` output; vLLM: usage.prompt_tokens_details).
Per system: throughput, FastGen's effective throughput (fastgen_bench.summarize), TTFT p50 of
cache hits and misses, and the hit rate from the server's own Prometheus counters.

Writes --out (default perf/results/2026-11-23-prefix-caching/): raw.json.gz and summary.md (--quick:
raw-quick.json.gz and summary-quick.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import ROOT, RESULTS, CACHE, VENV_VLLM  # noqa: E402

from perf.served import closed_loop as cl  # noqa: E402
from perf.served import fastgen_metrics as fm  # noqa: E402
from perf.common import workload as wl  # noqa: E402
from splitfuse.utils.ports import free_port  # noqa: E402
from perf.served.drivers import grpc_inputs, stream_sse  # noqa: E402
from perf.served.fastgen_servers import stop_server, wait_vllm_ready  # noqa: E402
from perf.common.helpers import add_output_options  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit, mem_gib  # noqa: E402

HIT_SHARE = 0.5
"""A request counts as a cache hit when at least this share of its prompt was cached."""
CHAT_SLA_PROMPT_TPS = fm.SLA_PROMPT_TOKENS_PER_S


def log(msg: str) -> None:
    print(f"[prefix_cache_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------- workloads
@dataclass
class Conversation:
    idx: int
    system: str
    user_turns: list[str]
    gen_tokens: list[int]


def make_chat_workload(model_dir: str, args) -> list[Conversation]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    systems = [wl.make_prompt(tok, args.system_tokens, rng)[0] for _ in range(args.system_prompts)]
    convs = []
    for i in range(args.conversations):
        n_turns = args.turns
        users = [wl.make_prompt(tok, n, rng)[0] for n in
                 wl.draw_lengths(n_turns, args.user_mean, wl.VARIANCE, 8, 4 * args.user_mean, rng)]
        gens = wl.draw_lengths(n_turns, args.gen_mean, wl.VARIANCE, 2, 4 * args.gen_mean, rng)
        convs.append(Conversation(i, systems[i % len(systems)], [f"\nUser {i}: {u}" for u in users], gens))
    return convs


def turn_prompt(conv: Conversation, turn: int, answers: list[str]) -> str:
    parts = [conv.system]
    for k in range(turn):
        parts += [conv.user_turns[k], "\nAssistant:", answers[k]]
    parts += [conv.user_turns[turn], "\nAssistant:"]
    return "".join(parts)


def make_unshared_workload(model_dir: str, args) -> list[wl.RequestSpec]:
    # make_workload opens every prompt with its request number: no two share even their first block.
    return wl.make_workload(model_dir, args.unshared_requests, args.unshared_prompt_mean, args.unshared_gen_mean,
                            seed=args.seed + 1, max_model_len=args.max_model_len)


# ---------------------------------------------------------------------------------- drivers
@dataclass
class Turn:
    """One request's record plus what the prefix cache did for it."""

    record: dict
    conversation: int = -1
    turn: int = -1
    cached_tokens: int | None = None
    text: str = field(default="", repr=False)


class TritonChat:
    """Streams through our `ensemble` (tokenized by the server, as vLLM tokenizes its prompt)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.g = grpcclient
        self.url = url
        self.local = threading.local()

    def run(self, prompt: str, gen: int, idx: int, client: int, timeout: float) -> Turn:
        import numpy as np

        g = self.g
        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = g.InferenceServerClient(self.url)
        values = {"text_input": (np.array([[prompt.encode()]], dtype=object), "BYTES"),
                  "max_tokens": (np.array([[gen]], np.int32), "INT32"),
                  "temperature": (np.array([[0.0]], np.float32), "FP32"),
                  "stream": (np.array([[True]]), "BOOL"), "ignore_eos": (np.array([[True]]), "BOOL"),
                  "return_num_input_tokens": (np.array([[True]]), "BOOL"),
                  "return_num_cached_tokens": (np.array([[True]]), "BOOL")}
        inputs = grpc_inputs(values)
        events: queue.Queue = queue.Queue()
        rec = fm.RequestRecord(idx, client, 0, gen, start=0.0)
        text, cached = [], None
        c.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
        try:
            rec.start = time.perf_counter()
            c.async_stream_infer("ensemble", inputs, request_id=str(idx), enable_empty_final_response=True)
            while True:
                t, result, error = events.get(timeout=timeout)
                if error is not None:
                    rec.error = str(error)
                    break
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    rec.chunks.append((t, int(ids.size)))
                out = result.as_numpy("text_output")
                if out is not None and out.size:
                    text.append(bytes(out.reshape(-1)[0]).decode("utf-8", "replace"))
                n_in = result.as_numpy("num_input_tokens")
                if n_in is not None and n_in.size:
                    rec.prompt_tokens = rec.server_prompt_tokens = int(n_in.reshape(-1)[0])
                n_cached = result.as_numpy("num_cached_tokens")
                if n_cached is not None and n_cached.size:
                    cached = int(n_cached.reshape(-1)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    rec.end = t
                    break
        except queue.Empty:
            rec.error = "timeout"
        finally:
            rec.end = rec.end or time.perf_counter()
            c.stop_stream(cancel_requests=rec.error is not None)
        return Turn(rec.to_json(), cached_tokens=cached, text="".join(text))


class OpenAIChat:
    """Streaming /v1/completions (vLLM): text, token counts and cached prompt tokens."""

    def __init__(self, port: int) -> None:
        self.port = port

    def run(self, prompt: str, gen: int, idx: int, client: int, timeout: float) -> Turn:
        body = {"model": "bench", "prompt": prompt, "max_tokens": gen, "min_tokens": gen, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        rec = fm.RequestRecord(idx, client, 0, gen, start=0.0)
        text: list[str] = []
        cached: list[int | None] = [None]

        def on_event(msg: dict, t: float) -> None:
            usage = msg.get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = rec.server_prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached[0] = int(details["cached_tokens"])
            for choice in msg.get("choices") or []:
                n = len(choice.get("token_ids") or [])
                if n:
                    rec.chunks.append((t, n))
                text.append(choice.get("text") or "")

        stream_sse("127.0.0.1", self.port, "/v1/completions", body, rec, timeout, on_event, done_marker=b"[DONE]")
        return Turn(rec.to_json(), cached_tokens=cached[0], text="".join(text))


# ---------------------------------------------------------------------------------- load
def _closed_loop(items: list, clients: int, run_item: Callable[[Any, int], Iterator[Turn]]) -> list[Turn]:
    """Closed loop: `clients` threads, each taking the next of `items` and running it
    (`run_item(item, client)` yields its turns) until none is left; every turn, by start time."""
    todo: queue.Queue = queue.Queue()
    for item in items:
        todo.put(item)
    turns: list[Turn] = []
    lock = threading.Lock()

    def worker(cid: int) -> None:
        while True:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            for t in run_item(item, cid):
                with lock:
                    turns.append(t)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(turns, key=lambda t: t.record["start"])


def run_chat(driver, convs: list[Conversation], clients: int, timeout: float) -> list[Turn]:
    """Closed loop: each client takes the next conversation and runs its turns in order."""

    def conversation(conv: Conversation, cid: int) -> Iterator[Turn]:
        answers: list[str] = []
        for k in range(len(conv.user_turns)):
            idx = conv.idx * 100 + k
            t = driver.run(turn_prompt(conv, k, answers), conv.gen_tokens[k], idx, cid, timeout)
            t.conversation, t.turn = conv.idx, k
            yield t
            if t.record["error"]:
                break
            answers.append(t.text)

    return _closed_loop(convs, clients, conversation)


def run_unshared(driver, specs: list[wl.RequestSpec], clients: int, timeout: float) -> list[Turn]:
    """Closed loop over single requests sharing no prefix."""
    return _closed_loop(specs, clients, lambda s, cid: iter([driver.run(s.prompt, s.gen_tokens, s.idx, cid, timeout)]))


# ---------------------------------------------------------------------------------- servers
def prom_sum(url: str, names: tuple[str, ...]) -> float:
    """Sum of the samples of the first metric family in `names` that the endpoint exposes."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for name in names:
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(name) and (line[len(name)] in " {") and not line.startswith("#")]
        if values:
            return sum(values)
    return float("nan")


OURS_COUNTERS = (("splitfuse_prefix_cache_queries_total",), ("splitfuse_prefix_cache_hits_total",))
VLLM_COUNTERS = (("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
                 ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"))


class Ours:
    def __init__(self, args, caching: bool) -> None:
        self.args, self.caching = args, caching
        self.params = {"token_budget": str(args.token_budget), "enable_prefix_caching": str(caching).lower(),
                       "report_num_cached_tokens": "true",  # one tenant: the bench reads its own hits
                       "max_model_len": str(args.max_model_len), **dict(p.split("=", 1) for p in args.param)}

    def __enter__(self):
        from splitfuse.launcher import serve

        self._cm = serve(self.args.model_dir, self.params, workdir=Path(self.args.workdir) / "ours",
                         ready_timeout_s=600)
        srv = self._cm.__enter__()
        self.driver = TritonChat(srv.grpc_url)
        self.metrics_url = srv.metrics_url
        self.pid = srv.process.pid
        self.describe = {"kind": "triton", "params": self.params}
        return self

    def counters(self) -> tuple[float, float]:
        time.sleep(0.6)  # the llm model publishes metrics about every 0.5 s
        return tuple(prom_sum(self.metrics_url, names) for names in OURS_COUNTERS)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


class VLLM:
    def __init__(self, args, threads_bind: str | None = None, env: dict[str, str] | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.args = args
        self.threads_bind = threads_bind
        self.env, self.extra_args = dict(env or {}), tuple(extra_args)  # e.g. kv_tiers_bench's small KV pool

    def __enter__(self):
        a = self.args
        port = free_port()
        cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(a.model_dir).resolve()),
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(a.max_model_len), "--enable-prefix-caching", "--enable-prompt-tokens-details",
               *self.extra_args]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.update(self.env)
        if self.threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.threads_bind
        env.pop("VIRTUAL_ENV", None)
        log_path = Path(a.workdir) / "vllm" / "server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, cwd=str(ROOT))
        try:
            wait_vllm_ready(self.proc, port, 600, log_path)
        except Exception:
            self.__exit__()
            raise
        self.driver = OpenAIChat(port)
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.pid = self.proc.pid
        self.log_path = log_path
        self.describe = {"kind": "openai", "cmd": cmd[1:], "VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"],
                         "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "(vLLM default)")}
        return self

    def counters(self) -> tuple[float, float]:
        time.sleep(1.0)
        return tuple(prom_sum(self.metrics_url, names) for names in VLLM_COUNTERS)

    def __exit__(self, *exc):
        stop_server(self.proc)
        return False


# ---------------------------------------------------------------------------------- one system
def measure(server, run, warm, *run_args) -> dict:
    """Warm up (requests sharing nothing with the workload), then run and summarize."""
    for i, prompt in enumerate(warm):
        t = server.driver.run(prompt, 4, 900000 + i, 0, 300)
        if t.record["error"]:
            raise RuntimeError(f"warm-up failed: {t.record['error']}")
    q0, h0 = server.counters()
    load = os.getloadavg()
    roots = [os.getpid(), server.pid]
    cpu0 = cl.cpu_snapshot(roots)
    t0 = time.time()
    turns = run(server.driver, *run_args)
    wall = time.time() - t0
    cpu = cl.cpu_usage(cpu0, cl.cpu_snapshot(roots))
    q1, h1 = server.counters()
    recs = [fm.RequestRecord.from_json(t.record) for t in turns]
    m = fm.summarize(recs, prompt_tps=CHAT_SLA_PROMPT_TPS)
    hits = [t for t in turns if t.cached_tokens is not None and t.record["prompt_tokens"]
            and t.cached_tokens >= HIT_SHARE * t.record["prompt_tokens"]]
    misses = [t for t in turns if t.cached_tokens is not None and t not in hits]
    ttft = lambda ts: [x for x in (fm.ttft(fm.RequestRecord.from_json(t.record)) for t in ts) if x is not None]  # noqa: E731
    m.update(
        wall_s=wall, loadavg_before=load, loadavg_after=os.getloadavg(), cpu=cpu,
        cached_tokens_reported=sum(t.cached_tokens or 0 for t in turns),
        prompt_tokens_total=sum(t.record["prompt_tokens"] for t in turns),
        cached_reported_requests=sum(t.cached_tokens is not None for t in turns),
        num_hits=len(hits), num_misses=len(misses),
        ttft_p50_hits_s=fm.percentile(ttft(hits), 50), ttft_p50_misses_s=fm.percentile(ttft(misses), 50),
        server_prefix_cache_queries=q1 - q0, server_prefix_cache_hits=h1 - h0,
    )
    m["server_hit_rate"] = m["server_prefix_cache_hits"] / m["server_prefix_cache_queries"] \
        if m["server_prefix_cache_queries"] else float("nan")
    m["reported_hit_rate"] = m["cached_tokens_reported"] / m["prompt_tokens_total"] if m["prompt_tokens_total"] else 0
    log(f"  {len(turns)} requests, errors={m['errors']}, thr={m.get('throughput_rps', float('nan')):.3f} rps, "
        f"eff@4={m.get('effective_rps@4', float('nan')):.3f}, ttft p50={m.get('p50_ttft_s', float('nan')):.3f}s "
        f"(hits {m['ttft_p50_hits_s']:.3f}s n={len(hits)}, misses {m['ttft_p50_misses_s']:.3f}s n={len(misses)}), "
        f"hit rate {m['reported_hit_rate']:.2f} (server counters {m['server_hit_rate']:.2f}), {wall:.0f}s, "
        f"load {load[0]:.1f}")
    return {"metrics": m, "turns": [asdict(t) | {"text": None} for t in turns]}


# ---------------------------------------------------------------------------------- bookkeeping
def bookkeeping_cost(num_requests: int = 16, prompt: int = 384, gen: int = 32, budget: int = 256,
                     repeats: int = 5) -> dict:
    """CPU time of the scheduler + block manager alone (no model) over a no-shared-prefix
    workload, caching off vs on: what caching adds to every engine step, free of server noise."""
    from splitfuse.engine.block_manager import BlockManager
    from splitfuse.engine.scheduler import Scheduler
    from splitfuse.engine.sequence import SamplingParams, Sequence

    def once(caching: bool) -> float:
        rng = random.Random(0)
        sched = Scheduler(BlockManager(4096, 16, 0.01, enable_prefix_caching=caching), budget, 256, "splitfuse")
        live = {Sequence(f"r{i}", [rng.randrange(3, 900) for _ in range(prompt)], SamplingParams(max_tokens=gen),
                         arrival=i) for i in range(num_requests)}
        for seq in sorted(live, key=lambda q: q.arrival):
            sched.add(seq)
        t = time.perf_counter()
        while live:
            out = sched.schedule()
            sampling = [c.seq for c in out.chunks if c.samples]
            sched.advance(out)
            for seq in sampling:
                seq.append_token(7)
                if seq.num_output_tokens >= gen:
                    sched.finish(seq)
                    live.discard(seq)
        return time.perf_counter() - t

    off = min(once(False) for _ in range(repeats))
    on = min(once(True) for _ in range(repeats))
    return {"requests": num_requests, "prompt": prompt, "gen": gen, "off_ms": off * 1e3, "on_ms": on * 1e3,
            "added_ms_per_request": (on - off) * 1e3 / num_requests}


# ---------------------------------------------------------------------------------- report
def _f(v, nd=3) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _ratio(a, b) -> float:
    try:
        return a / b if b else float("nan")
    except TypeError:
        return float("nan")


def write_summary(out: Path, doc: dict, filename: str = "summary.md") -> Path:
    meta, chat, unshared = doc["meta"], doc["chat"], doc["unshared"]
    lines = [
        "# Prefix caching, served (chat workload)", "",
        f"{meta['date']}; {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['machine']['ram_gib']:.0f} GiB), commit {meta['commit']}; model {meta['model_dir']} "
        f"({meta['model']}); command `{meta['command']}`.", "",
        f"Chat workload: {meta['chat']}.", "",
        "| system | requests | errors | throughput (req/s) | effective req/s @2/@4/@6 tok/s | TTFT p50 (s) | "
        "TTFT p50 hits / misses (s) [n] | prompt tokens cached (reported / server counters) | "
        "load avg before -> after | other processes (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in chat.items():
        m = r["metrics"]
        cpu = (m.get("cpu") or {}).get("foreign_cores_busy")
        lines.append(
            f"| {name} | {m['requests']} | {m['errors']} | {_f(m.get('throughput_rps'))} | "
            f"{_f(m.get('effective_rps@2'))} / {_f(m.get('effective_rps@4'))} / {_f(m.get('effective_rps@6'))} | "
            f"{_f(m.get('p50_ttft_s'))} | {_f(m['ttft_p50_hits_s'])} / {_f(m['ttft_p50_misses_s'])} "
            f"[{m['num_hits']} / {m['num_misses']}] | {_f(m['reported_hit_rate'], 2)} / {_f(m['server_hit_rate'], 2)} | "
            f"{m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f} | {_f(cpu, 2)} |")
    lines += ["", f"A hit is a request with at least {HIT_SHARE:.0%} of its prompt cached. Effective throughput: "
              f"FastGen's SLA (TTFT <= prompt tokens / {CHAT_SLA_PROMPT_TPS:g} s, EMA of token gaps below 1/R s) "
              "from perf/served/fastgen_bench.py.", ""]
    on, off = chat.get("ours_cache_on"), chat.get("ours_cache_off")
    # The better vLLM configuration run (own binding, or both cores computing).
    peers = [v for k, v in chat.items() if k.startswith("vllm")]
    vl = max(peers, key=lambda v: v["metrics"].get("effective_rps@4") or 0.0) if peers else None
    lines += ["## Targets (issue #10)", "", "| target | measured | met |", "|---|---|---|"]
    if on and vl:
        r = _ratio(on["metrics"].get("effective_rps@4"), vl["metrics"].get("effective_rps@4"))
        r2 = _ratio(on["metrics"].get("throughput_rps"), vl["metrics"].get("throughput_rps"))
        lines.append(f"| effective throughput (@4 tok/s) >= 1.5x vLLM-CPU's | {_f(r, 2)}x "
                     f"(raw throughput {_f(r2, 2)}x) | {'yes' if r == r and r >= 1.5 else 'no'} |")
    if on:
        m = on["metrics"]
        r = _ratio(m["ttft_p50_hits_s"], m["ttft_p50_misses_s"])
        lines.append(f"| TTFT p50 of hits <= 0.3x of misses (same run) | {_f(r, 2)}x | "
                     f"{'yes' if r == r and r <= 0.3 else 'no'} |")
        if off:
            r = _ratio(m["ttft_p50_hits_s"], off["metrics"].get("p50_ttft_s"))
            lines.append(f"| TTFT p50 of hits vs every request with caching off | {_f(r, 2)}x | "
                         f"{'yes' if r == r and r <= 0.3 else 'no'} |")
    if unshared:
        thr = {k: [p["metrics"]["throughput_rps"] for p in v] for k, v in unshared.items()}
        mean = {k: sum(v) / len(v) for k, v in thr.items() if v}
        ratio = _ratio(mean.get("on"), mean.get("off"))
        spread = max(max(v) / min(v) for v in thr.values() if v)
        verdict = "yes" if ratio >= 0.97 else "no"
        if spread > 1.06:
            verdict += f" (but runs of one setting differ by up to {spread:.1f}x here: too noisy to resolve 3%)"
        lines.append(f"| no shared prefix: caching on within 3% of off | mean throughput on / off = {_f(ratio, 2)} "
                     f"(on {', '.join(_f(x) for x in thr['on'])} vs off {', '.join(_f(x) for x in thr['off'])} req/s) "
                     f"| {verdict} |")
        lines += ["", f"No-shared-prefix workload: {meta['unshared']}; hit rates (server counters): "
                  + ", ".join(f"{k}: {_f(p['metrics']['server_hit_rate'], 3)}" for k, v in unshared.items() for p in v)
                  + "; TTFT p50 on " + ", ".join(_f(p["metrics"].get("p50_ttft_s")) for p in unshared["on"])
                  + " s vs off " + ", ".join(_f(p["metrics"].get("p50_ttft_s")) for p in unshared["off"]) + " s."]
    if doc.get("bookkeeping"):
        b = doc["bookkeeping"]
        lines += ["", f"Bookkeeping alone (scheduler + block manager, no model, best of 5): {b['requests']} requests "
                  f"of {b['prompt']} + {b['gen']} tokens sharing nothing take {b['off_ms']:.1f} ms with caching off, "
                  f"{b['on_ms']:.1f} ms on: {b['added_ms_per_request']:.2f} ms more per request (hashing its "
                  "full blocks, looking up its first), against ~1 s of model time per such request here."]
    lines += ["", "## Servers", ""] + [f"- {k}: `{json.dumps(v)}`" for k, v in meta["servers"].items()]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in meta.get("notes", [])]
    path = out / filename
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------- main
QUICK = dict(system_prompts=2, system_tokens=600, conversations=6, turns=2, user_mean=48, gen_mean=16, clients=3,
             unshared_requests=8, unshared_prompt_mean=256, unshared_gen_mean=16, unshared_repeats=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workloads, one on/off pair: a few minutes")
    ap.add_argument("--systems", default="ours_cache_on,ours_cache_off,vllm_cache_on")
    ap.add_argument("--model-dir", default=str(CACHE / "bench-llama"))
    ap.add_argument("--model-size", default="bench")
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-mean", type=int, default=64)
    ap.add_argument("--gen-mean", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--unshared-requests", type=int, default=16)
    ap.add_argument("--unshared-prompt-mean", type=int, default=384)
    ap.add_argument("--unshared-gen-mean", type=int, default=32)
    ap.add_argument("--unshared-repeats", type=int, default=2, help="on/off pairs of the no-shared-prefix run")
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="extra engine parameter for our server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--vllm-python", default=str(VENV_VLLM / "bin" / "python"))
    add_output_options(ap, RESULTS / "2026-11-23-prefix-caching", CACHE / "prefix-cache-run")
    ap.add_argument("--bookkeeping", action="store_true",
                    help="with --report-only: add the bookkeeping-cost measurement to a run that lacks it")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / ("raw-quick.json.gz" if args.quick else "raw.json.gz")
    summary_name = "summary-quick.md" if args.quick else "summary.md"
    if args.report_only:
        doc = json.loads(gzip.decompress(raw.read_bytes()))
        if args.bookkeeping and not doc.get("bookkeeping"):
            doc["bookkeeping"] = bookkeeping_cost(args.unshared_requests, args.unshared_prompt_mean,
                                                  args.unshared_gen_mean, args.token_budget)
        doc["meta"]["notes"] = list(dict.fromkeys(doc["meta"].get("notes", []) + args.note))
        raw.write_bytes(gzip.compress(json.dumps(doc).encode()))
        log(f"wrote {write_summary(out, doc, summary_name)}")
        return

    if not (Path(args.model_dir) / "config.json").is_file():
        log(f"building the {args.model_size} checkpoint in {args.model_dir}")
        subprocess.run([sys.executable, "-m", "splitfuse.tools.demo_model", args.model_dir, "--arch", "llama",
                        "--size", args.model_size], check=True)
    convs = make_chat_workload(args.model_dir, args)
    unshared = make_unshared_workload(args.model_dir, args)
    warm = [f"Warm-up {i}: " + wl._PASSAGES[i] for i in range(2)]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": git_commit(),
        "machine": {"cpu": cpu_model(), "cpu_flags": " ".join(cpu_flags()), "cores": os.cpu_count(),
                    "ram_gib": mem_gib()},
        "model_dir": args.model_dir, "model": f"demo_model size {args.model_size}",
        "command": "perf/served/prefix_cache_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "chat": (f"{args.system_prompts} system prompts of ~{args.system_tokens} tokens, {args.conversations} "
                 f"conversations x {args.turns} turns (user messages ~{args.user_mean} tokens, answers "
                 f"~{args.gen_mean} tokens, each turn's prompt = system + history + new message), "
                 f"{args.clients} closed-loop clients, greedy, ignore_eos; our token_budget {args.token_budget}"),
        "unshared": (f"{args.unshared_requests} requests, prompts ~{args.unshared_prompt_mean} tokens, "
                     f"~{args.unshared_gen_mean} generated, {args.clients} clients, {args.unshared_repeats} on/off "
                     "pairs (alternating, one server start each)"),
        "servers": {}, "notes": list(args.note),
        "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    doc: dict[str, Any] = {"meta": meta, "chat": {}, "unshared": {}}
    for name in systems:
        log(f"chat workload: {name}")
        if name.startswith("vllm"):
            server = VLLM(args, threads_bind="0-1" if name.startswith("vllm_2c") else None)
        else:
            server = Ours(args, caching=name == "ours_cache_on")
        try:
            with server:
                meta["servers"][name] = server.describe
                doc["chat"][name] = measure(server, run_chat, warm, convs, args.clients, args.request_timeout)
        except Exception as exc:  # noqa: BLE001 - the other systems still run
            log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            meta["notes"].append(f"{name} failed: {type(exc).__name__}: {exc}")
    if args.unshared_repeats:
        doc["unshared"] = {"on": [], "off": []}
        for rep in range(args.unshared_repeats):
            for mode in ("on", "off"):
                log(f"no-shared-prefix workload: caching {mode} ({rep + 1}/{args.unshared_repeats})")
                with Ours(args, caching=mode == "on") as server:
                    doc["unshared"][mode].append(
                        measure(server, run_unshared, warm, unshared, args.clients, args.request_timeout))
    doc["bookkeeping"] = bookkeeping_cost(args.unshared_requests, args.unshared_prompt_mean, args.unshared_gen_mean,
                                          args.token_budget)
    meta["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    meta["notes"].append(f"uptime before: {meta['uptime_before']}; after: {meta['uptime_after']}")
    raw.write_bytes(gzip.compress(json.dumps(doc).encode()))
    log(f"wrote {write_summary(out, doc, summary_name)}")


if __name__ == "__main__":
    main()
