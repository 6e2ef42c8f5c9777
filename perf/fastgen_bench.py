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
* Throughput (requests/s) = completed requests / (last end - first start); latency = mean
  end-to-end request time.
* Effective throughput = throughput x share of requests meeting the SLA: first token within
  |prompt tokens| / 512 s, and the exponential moving average (span 16, pandas `ewm(span=16)`
  with its default `adjust=True` weighting, as the FastGen scripts use) of every later
  inter-token gap below 1/R s for R = 2, 4, 6 tokens/s.
* Token latency: P50/P90/P95 of the gaps between consecutive tokens (the first token is excluded:
  it is the time to first token, reported separately). When one streamed response carries k > 1
  tokens, its gap is split evenly over the k tokens (recorded as it arrived in the raw file).

Drivers: Triton (tritonclient gRPC streaming against our `ensemble` or `llm` model, TensorRT-LLM
tensor names) and any OpenAI-compatible server (streaming /v1/completions, e.g. vLLM).

    python perf/fastgen_bench.py run --target triton --url 127.0.0.1:8001 --model ensemble \
        --model-dir perf/.cache/bench-llama --clients 1,2,4,8 --out perf/results/raw/splitfuse.json
    python perf/fastgen_bench.py run --target openai --url http://127.0.0.1:8000 --model bench ...
    python perf/fastgen_bench.py report perf/results/raw/*.json
    python perf/fastgen_bench.py pa-input ...     # perf_analyzer --input-data file
    python perf/fastgen_bench.py pa-summary ...   # summary of perf_analyzer profile exports
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import queue
import random
import statistics
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# --------------------------------------------------------------------------------------------
# Constants of the FastGen SLA
# --------------------------------------------------------------------------------------------
SLA_PROMPT_TOKENS_PER_S = 512.0
SLA_GEN_RATES = (2.0, 4.0, 6.0)
EMA_SPAN = 16
VARIANCE = 0.3
BLOG_PROMPT_MEANS = (1200, 2600)
BLOG_GEN_MEANS = (60, 128)

# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------
# Prompt source text (written for this benchmark): ordinary prose on assorted subjects, so
# prompts look like user requests rather than repeated tokens. Each prompt starts at a random
# sentence, so prompts do not share long prefixes (no system gets a prefix-cache advantage).
_PASSAGES = [
    "Please summarise the following notes from our weekly planning meeting.",
    "The harbour town wakes early; fishing boats leave before dawn and return by noon with the catch.",
    "Our team moved the billing service to a new database last spring, and latency dropped by a third.",
    "Explain in simple words why the sky looks blue during the day and red at sunset.",
    "A good sourdough starter needs flour, water, patience and a warm corner of the kitchen.",
    "The museum opened a new wing dedicated to maps drawn by sailors in the sixteenth century.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "When the river flooded, volunteers filled sandbags through the night to protect the school.",
    "The committee reviewed three proposals for the park and chose the one with the most trees.",
    "Compare the advantages of trains and aeroplanes for a journey of about five hundred kilometres.",
    "Her grandfather kept bees on the hillside and sold honey at the Saturday market.",
    "Translate the menu into plain English so that visitors can order without help.",
    "The spacecraft will reach the outer planets in nine years if the launch window holds.",
    "List the steps needed to replace a flat bicycle tyre on the side of a mountain road.",
    "Scientists measured the temperature of the lake every hour for an entire year.",
    "The orchestra rehearsed the final movement until the conductor was finally satisfied.",
    "Describe a quiet morning in a mountain village after the first snow of winter.",
    "Customers asked for a dark mode, faster search and an easier way to export their data.",
    "The old bridge was closed for repairs, so traffic was diverted through the city centre.",
    "Give three reasons why regular sleep matters for memory and concentration.",
    "In the garden the tomatoes ripened late, but the beans grew faster than anyone expected.",
    "The library extended its opening hours during exam season to help students study.",
    "Draft a polite email asking a supplier to confirm the delivery date of our order.",
    "Astronomers spotted a comet that will be visible to the naked eye next month.",
    "The chef explained that fresh herbs should be added at the very end of cooking.",
    "Write a haiku about the sound of rain on a tin roof in late summer.",
    "The city council approved new bicycle lanes along the river and near the station.",
    "Engineers tested the robot arm by asking it to stack cups of different sizes.",
    "Outline a lesson plan that introduces fractions to children aged nine and ten.",
    "The travellers crossed the desert at night, guided by the stars and an old compass.",
]


@dataclass
class RequestSpec:
    """One request of the workload; identical for every system under test."""

    idx: int
    prompt: str
    prompt_tokens: int
    """Prompt length in tokens as the checkpoint's tokenizer counts it (with special tokens)."""
    gen_tokens: int
    """Number of tokens to generate (exactly: ignore_eos / min_tokens)."""


def draw_lengths(n: int, mean: float, variance: float, lo: int, hi: int, rng: random.Random) -> list[int]:
    """n integer lengths ~ Normal(mean, variance*mean), rounded and clipped to [lo, hi]."""
    return [min(hi, max(lo, int(round(rng.gauss(mean, variance * mean))))) for _ in range(n)]


def _text_source(rng: random.Random, approx_chars: int) -> str:
    start = rng.randrange(len(_PASSAGES))
    parts: list[str] = []
    size = 0
    i = start
    while size < approx_chars:
        s = _PASSAGES[i % len(_PASSAGES)]
        parts.append(s)
        size += len(s) + 1
        i += 1 + (rng.random() < 0.3)  # skip now and then so sentence order varies
    return " ".join(parts)


def make_prompt(tokenizer: Any, n_tokens: int, rng: random.Random) -> tuple[str, int]:
    """Prose whose tokenization (with special tokens) has about `n_tokens` tokens.

    Returns (text, exact token count of the text as the tokenizer encodes it).
    """
    special = len(tokenizer("").input_ids)  # BOS etc. added by the server's tokenizer too
    want = max(1, n_tokens - special)
    text = _text_source(rng, approx_chars=want * 6 + 64)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < want:  # very dense tokenizers: grow
        text += " " + _text_source(rng, approx_chars=want * 6)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    text = tokenizer.decode(ids[:want])
    # Decoding a byte-level prefix and re-encoding can shift the count by a token or two.
    for _ in range(4):
        count = len(tokenizer(text, add_special_tokens=False).input_ids)
        if count <= want:
            break
        ids2 = tokenizer(text, add_special_tokens=False).input_ids[: want - (count - want)]
        text = tokenizer.decode(ids2)
    return text, len(tokenizer(text).input_ids)


def make_workload(
    model_dir: str,
    num_requests: int,
    prompt_mean: float,
    gen_mean: float,
    variance: float = VARIANCE,
    seed: int = 0,
    max_model_len: int | None = None,
    min_prompt: int = 8,
    min_gen: int = 2,
) -> list[RequestSpec]:
    """The request list: lengths from the seeded normals, prompts built to those lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if max_model_len is None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        max_model_len = int(cfg.get("max_position_embeddings", 4096))
    rng = random.Random(seed)
    gens = draw_lengths(num_requests, gen_mean, variance, min_gen, max_model_len // 4, rng)
    prompts = draw_lengths(num_requests, prompt_mean, variance, min_prompt, max_model_len, rng)
    specs = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        p = min(p, max_model_len - g - 4)
        text, count = make_prompt(tokenizer, p, rng)
        specs.append(RequestSpec(idx=i, prompt=text, prompt_tokens=count, gen_tokens=g))
    return specs


# --------------------------------------------------------------------------------------------
# Per-request records and the metrics
# --------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    idx: int
    client: int
    prompt_tokens: int
    gen_tokens: int
    start: float
    end: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, tokens in that streamed response), absolute perf_counter seconds."""
    error: str | None = None
    server_prompt_tokens: int | None = None
    server_output_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def latency(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        d = dict(d)
        d["chunks"] = [tuple(c) for c in d.get("chunks", [])]
        return cls(**d)


def token_gen_times(rec: RequestRecord) -> list[float]:
    """[time to first token, gap to token 2, gap to token 3, ...] (FastGen's token_gen_time).

    Streamed responses with no token (e.g. an empty final response) are ignored; a response with
    k tokens after a gap g contributes k gaps of g / k (the first token's share goes to TTFT).
    """
    out: list[float] = []
    prev = rec.start
    for t, n in rec.chunks:
        if n <= 0:
            continue
        if not out:
            # The first token's time is the whole wait for the first response (TTFT); tokens
            # that came with it arrived at the same moment.
            out.append(t - prev)
            out.extend([0.0] * (n - 1))
        else:
            out.extend([(t - prev) / n] * n)
        prev = t
    return out


def ttft(rec: RequestRecord) -> float | None:
    for t, n in rec.chunks:
        if n > 0:
            return t - rec.start
    return None


def ema(values: Sequence[float], span: int = EMA_SPAN) -> list[float]:
    """Exponential moving average like pandas `Series.ewm(span=span).mean()` (adjust=True).

    y_t = sum_{i<=t} (1-a)^(t-i) x_i / sum_{i<=t} (1-a)^(t-i),  a = 2 / (span + 1).
    """
    a = 2.0 / (span + 1.0)
    num = 0.0
    den = 0.0
    out = []
    for x in values:
        num = x + (1.0 - a) * num
        den = 1.0 + (1.0 - a) * den
        out.append(num / den)
    return out


def meets_sla(
    rec: RequestRecord,
    gen_rate: float,
    prompt_tps: float = SLA_PROMPT_TOKENS_PER_S,
    span: int = EMA_SPAN,
) -> bool:
    """FastGen's SLA: TTFT <= |prompt| / prompt_tps and EMA(inter-token gaps) < 1/gen_rate."""
    if not rec.ok:
        return False
    times = token_gen_times(rec)
    if not times:
        return False
    if times[0] > rec.prompt_tokens / prompt_tps:
        return False
    if len(times) == 1:
        return True
    return all(v < 1.0 / gen_rate for v in ema(times[1:], span))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    records: Sequence[RequestRecord],
    gen_rates: Iterable[float] = SLA_GEN_RATES,
    prompt_tps: float = SLA_PROMPT_TOKENS_PER_S,
    span: int = EMA_SPAN,
) -> dict:
    """Metrics of one load point (one system, one client count)."""
    done = [r for r in records if r.ok]
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
    }
    if not done:
        return out
    t0 = min(r.start for r in records)
    t1 = max(r.end for r in done)
    duration = t1 - t0
    thr = len(done) / duration if duration > 0 else float("nan")
    gaps = [g for r in done for g in token_gen_times(r)[1:]]
    ttfts = [x for x in (ttft(r) for r in done) if x is not None]
    out.update(
        duration_s=duration,
        throughput_rps=thr,
        output_tokens_per_s=sum(r.output_tokens for r in done) / duration if duration > 0 else float("nan"),
        mean_latency_s=statistics.fmean(r.latency for r in done),
        p50_latency_s=percentile([r.latency for r in done], 50),
        mean_ttft_s=statistics.fmean(ttfts) if ttfts else float("nan"),
        p50_ttft_s=percentile(ttfts, 50),
        p95_ttft_s=percentile(ttfts, 95),
        token_latency_p50_s=percentile(gaps, 50),
        token_latency_p90_s=percentile(gaps, 90),
        token_latency_p95_s=percentile(gaps, 95),
        token_latency_p99_s=percentile(gaps, 99),
        mean_prompt_tokens=statistics.fmean(r.prompt_tokens for r in done),
        mean_output_tokens=statistics.fmean(r.output_tokens for r in done),
        length_mismatches=sum(1 for r in done if r.output_tokens != r.gen_tokens),
        multi_token_chunks=sum(1 for r in done for _, n in r.chunks if n > 1),
        ttft_sla_ok_frac=sum(1 for r in done if (ttft(r) or 1e9) <= r.prompt_tokens / prompt_tps) / len(records),
    )
    for rate in gen_rates:
        ok = sum(1 for r in done if meets_sla(r, rate, prompt_tps, span))
        key = f"{rate:g}"
        out[f"sla_ok_frac@{key}"] = ok / len(records)
        out[f"effective_rps@{key}"] = thr * ok / len(records)
    return out


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------
class Driver:
    name = "driver"

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TritonDriver(Driver):
    """Streams one request at a time over tritonclient gRPC (one stream per client thread).

    Token counting per streamed response: the length of `output_ids` when the model returns it,
    else the increase of `num_output_tokens`, else one token per non-empty `text_output`.
    """

    name = "triton"

    def __init__(self, url: str, model: str = "ensemble", temperature: float = 0.0):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url = url
        self.model = model
        self.temperature = temperature
        probe = grpcclient.InferenceServerClient(url)
        meta = probe.get_model_metadata(model, as_json=True)
        probe.close()
        self.input_names = {i["name"]: i["datatype"] for i in meta.get("inputs", [])}
        self.output_names = [o["name"] for o in meta.get("outputs", [])]
        self._local = threading.local()

    def _client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._grpc.InferenceServerClient(self.url)
            self._local.client = c
        return c

    def _inputs(self, spec: RequestSpec) -> list:
        import numpy as np

        g = self._grpc
        values: dict[str, tuple[Any, str]] = {
            "text_input": (np.array([[spec.prompt.encode("utf-8")]], dtype=object), "BYTES"),
            "max_tokens": (np.array([[spec.gen_tokens]], dtype=np.int32), "INT32"),
            "stream": (np.array([[True]], dtype=bool), "BOOL"),
            "ignore_eos": (np.array([[True]], dtype=bool), "BOOL"),
            "min_tokens": (np.array([[spec.gen_tokens]], dtype=np.int32), "INT32"),
            "temperature": (np.array([[self.temperature]], dtype=np.float32), "FP32"),
            "exclude_input_in_output": (np.array([[True]], dtype=bool), "BOOL"),
            "return_num_input_tokens": (np.array([[True]], dtype=bool), "BOOL"),
            "return_num_output_tokens": (np.array([[True]], dtype=bool), "BOOL"),
        }
        inputs = []
        for name, (arr, dtype) in values.items():
            if name not in self.input_names:
                continue
            want = self.input_names[name]
            if want != dtype:  # follow the model's declared type (e.g. INT64 max_tokens)
                np_type = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP16": np.float16,
                           "BOOL": bool, "UINT64": np.uint64}.get(want)
                if np_type is None:
                    continue
                arr = arr.astype(np_type)
                dtype = want
            inp = g.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return inputs

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        g = self._grpc
        c = self._client()
        events: queue.Queue = queue.Queue()

        def callback(result=None, error=None):
            events.put((time.perf_counter(), result, error))

        inputs = self._inputs(spec)
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=0.0)
        c.start_stream(callback=callback)
        try:
            rec.start = time.perf_counter()
            c.async_stream_infer(self.model, inputs, request_id=f"{spec.idx}-{client}",
                                 enable_empty_final_response=True)
            deadline = rec.start + timeout
            last_num_out = 0
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    rec.error = "timeout"
                    break
                try:
                    t, result, error = events.get(timeout=remaining)
                except queue.Empty:
                    rec.error = "timeout"
                    break
                if error is not None:
                    rec.error = str(error)
                    break
                n = 0
                got_count = False
                ids = result.as_numpy("output_ids") if "output_ids" in self.output_names else None
                if ids is not None:
                    n = int(ids.size)
                    got_count = True
                num_out = (result.as_numpy("num_output_tokens")
                           if "num_output_tokens" in self.output_names else None)
                if num_out is not None and num_out.size:
                    total = int(num_out.reshape(-1)[0])
                    if not got_count:
                        n = max(0, total - last_num_out)
                        got_count = True
                    last_num_out = max(last_num_out, total)
                    rec.server_output_tokens = total
                if not got_count:
                    text = result.as_numpy("text_output") if "text_output" in self.output_names else None
                    n = 1 if text is not None and text.size and len(text.reshape(-1)[0]) else 0
                num_in = (result.as_numpy("num_input_tokens")
                          if "num_input_tokens" in self.output_names else None)
                if num_in is not None and num_in.size:
                    rec.server_prompt_tokens = int(num_in.reshape(-1)[0])
                if n:
                    rec.chunks.append((t, n))
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    rec.end = t
                    break
        finally:
            if not rec.end:
                rec.end = time.perf_counter()
            c.stop_stream(cancel_requests=rec.error is not None)
        return rec

    def close(self) -> None:
        pass


class OpenAIDriver(Driver):
    """Streaming /v1/completions against an OpenAI-compatible server (vLLM).

    Tokens per SSE chunk: `choices[0].token_ids` when the server returns them (vLLM with
    `return_token_ids`), else the increase of `usage.completion_tokens` (continuous usage stats),
    else one per non-empty text chunk.
    """

    name = "openai"

    def __init__(self, url: str, model: str, temperature: float = 0.0):
        u = urllib.parse.urlparse(url if "://" in url else "http://" + url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base = u.path.rstrip("/")
        self.model = model
        self.temperature = temperature

    def run_one(self, spec: RequestSpec, client: int, timeout: float) -> RequestRecord:
        body = json.dumps({
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.gen_tokens,
            "min_tokens": spec.gen_tokens,
            "ignore_eos": True,
            "temperature": self.temperature,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }).encode()
        rec = RequestRecord(spec.idx, client, spec.prompt_tokens, spec.gen_tokens, start=0.0)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            rec.start = time.perf_counter()
            conn.request("POST", self.base + "/v1/completions", body=body,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return rec
            last_completion = 0
            deadline = rec.start + timeout
            while True:
                line = resp.readline()
                t = time.perf_counter()
                if not line:
                    break
                if t > deadline:
                    rec.error = "timeout"
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    rec.end = t
                    break
                msg = json.loads(payload)
                if "error" in msg:
                    rec.error = str(msg["error"])[:300]
                    break
                usage = msg.get("usage") or {}
                n = None
                choices = msg.get("choices") or []
                if choices:
                    tids = choices[0].get("token_ids")
                    if tids is not None:
                        n = len(tids)
                    pids = choices[0].get("prompt_token_ids")
                    if pids:
                        rec.server_prompt_tokens = len(pids)
                if usage.get("completion_tokens") is not None:
                    comp = int(usage["completion_tokens"])
                    if n is None and choices:
                        n = max(0, comp - last_completion)
                    last_completion = max(last_completion, comp)
                    rec.server_output_tokens = comp
                    if usage.get("prompt_tokens") is not None:
                        rec.server_prompt_tokens = int(usage["prompt_tokens"])
                if n is None:
                    n = 1 if choices and choices[0].get("text") else 0
                if n:
                    rec.chunks.append((t, n))
            if rec.error is None and not rec.end:
                rec.error = "stream ended without [DONE]"
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            if not rec.end:
                rec.end = time.perf_counter()
            conn.close()
        return rec


# --------------------------------------------------------------------------------------------
# Closed-loop load generation
# --------------------------------------------------------------------------------------------
def run_point(
    driver: Driver,
    specs: Sequence[RequestSpec],
    clients: int,
    num_requests: int,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 300.0,
    start_offset: int = 0,
) -> list[RequestRecord]:
    """`clients` closed-loop clients share the next `num_requests` requests of `specs`.

    Requests are taken in order from `specs` (cycling, starting at `start_offset`), so every
    system sees the same sequence. No new request starts after `time_limit_s`; those already
    in flight finish (bounded by `request_timeout_s`).
    """
    order = [specs[(start_offset + i) % len(specs)] for i in range(num_requests)]
    next_i = [0]
    lock = threading.Lock()
    records: list[RequestRecord] = []
    t_stop = time.perf_counter() + time_limit_s

    def take() -> RequestSpec | None:
        with lock:
            if next_i[0] >= len(order) or time.perf_counter() > t_stop:
                return None
            s = order[next_i[0]]
            next_i[0] += 1
            return s

    def worker(cid: int) -> None:
        while True:
            s = take()
            if s is None:
                return
            try:
                rec = driver.run_one(s, cid, request_timeout_s)
            except Exception as exc:  # noqa: BLE001
                now = time.perf_counter()
                rec = RequestRecord(s.idx, cid, s.prompt_tokens, s.gen_tokens, start=now, end=now,
                                    error=f"{type(exc).__name__}: {exc}")
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(time_limit_s + request_timeout_s + 60)
    return sorted(records, key=lambda r: r.start)


def _proc_tree(roots: Iterable[int]) -> set[int]:
    """`roots` and all their descendants (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree = set(r for r in roots if r in parent)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree


def cpu_snapshot(roots: Iterable[int]) -> tuple[float, float, float] | None:
    """(wall time, CPU seconds used by the whole machine, CPU seconds of the `roots` trees).

    Two snapshots give how many cores other processes (not the benchmark client, not the server
    under test) kept busy in between: the benchmark's noise on a shared machine.
    """
    try:
        hz = os.sysconf("SC_CLK_TCK")
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        vals = [int(x) for x in fields]
        busy = (sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)) / hz  # minus idle, iowait
        ours = 0.0
        for pid in _proc_tree(roots):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                f = stat[stat.rindex(")") + 2:].split()
                ours += (int(f[11]) + int(f[12])) / hz  # utime + stime
            except (OSError, ValueError, IndexError):
                continue
        return time.monotonic(), busy, ours
    except (OSError, ValueError):
        return None


def cpu_usage(before, after) -> dict | None:
    if not before or not after or after[0] - before[0] < 1.0:
        return None
    wall = after[0] - before[0]
    total = (after[1] - before[1]) / wall
    ours = (after[2] - before[2]) / wall
    return {"machine_cores_busy": total, "ours_cores_busy": ours, "foreign_cores_busy": max(0.0, total - ours)}


def requests_for(clients: int, per_client: int, minimum: int, maximum: int) -> int:
    return max(minimum, min(maximum, per_client * clients))


def sweep(
    driver: Driver,
    specs: Sequence[RequestSpec],
    client_counts: Sequence[int],
    per_client: int = 3,
    min_requests: int = 12,
    max_requests: int = 512,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 300.0,
    warmup: int = 2,
    log: Callable[[str], None] = print,
    server_pids: Callable[[], Iterable[int]] | None = None,
    start_offset: int = 0,
) -> dict:
    """Runs each client count in turn; returns {"points": [{clients, records, metrics, cpu}]}.

    `server_pids` (the server's root process ids) lets each point record how busy the machine's
    other processes were meanwhile (`cpu.foreign_cores_busy`).
    """
    if warmup:
        for s in specs[:warmup]:
            w = driver.run_one(RequestSpec(s.idx, s.prompt, s.prompt_tokens, min(s.gen_tokens, 8)), 0,
                               request_timeout_s)
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
    points = []
    offset = start_offset
    for c in client_counts:
        n = requests_for(c, per_client, min_requests, max_requests)
        t = time.perf_counter()
        roots = [os.getpid(), *(server_pids() if server_pids else [])]
        before = cpu_snapshot(roots)
        recs = run_point(driver, specs, c, n, time_limit_s, request_timeout_s, start_offset=offset)
        cpu = cpu_usage(before, cpu_snapshot(roots))
        offset += n
        m = summarize(recs)
        log(f"  clients={c:3d} requests={m['completed']}/{n} errors={m['errors']} "
            f"thr={m.get('throughput_rps', float('nan')):.3f} rps "
            f"lat={m.get('mean_latency_s', float('nan')):.2f}s "
            f"ttft_p50={m.get('p50_ttft_s', float('nan')):.2f}s "
            f"tok_p95={m.get('token_latency_p95_s', float('nan')) * 1000:.0f}ms "
            f"eff@4={m.get('effective_rps@4', float('nan')):.3f} ({time.perf_counter() - t:.0f}s"
            + (f", other processes {cpu['foreign_cores_busy']:.2f} cores)" if cpu else ")"))
        if m["errors"]:
            first = next(r.error for r in recs if r.error)
            log(f"    first error: {first}")
        points.append({"clients": c, "requests": n, "records": [r.to_json() for r in recs], "metrics": m,
                       "cpu": cpu})
    return {"points": points}


# --------------------------------------------------------------------------------------------
# perf_analyzer helpers
# --------------------------------------------------------------------------------------------
def write_pa_input(specs: Sequence[RequestSpec], path: str, extra: dict | None = None) -> None:
    """perf_analyzer --input-data JSON: one entry per request (shape [1] per tensor, batch 1)."""
    data = []
    for s in specs:
        entry = {
            "text_input": {"content": [s.prompt], "shape": [1]},
            "max_tokens": {"content": [s.gen_tokens], "shape": [1]},
            "stream": {"content": [True], "shape": [1]},
            "ignore_eos": {"content": [True], "shape": [1]},
        }
        if extra:
            entry.update(extra)
        data.append(entry)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"data": data}, ensure_ascii=False, indent=1))


def summarize_pa_profile(path: str) -> list[dict]:
    """Rows from a perf_analyzer --profile-export-file: per concurrency level, TTFT / ITL / latency."""
    doc = json.loads(Path(path).read_text())
    rows = []
    for exp in doc.get("experiments", []):
        mode = exp.get("experiment", {})
        reqs = exp.get("requests", [])
        ttfts, itls, lats = [], [], []
        for r in reqs:
            ts = r.get("timestamp")
            resp = r.get("response_timestamps") or []
            if ts is None or not resp:
                continue
            # Last response may be the empty final one; timestamps are ns.
            ttfts.append((resp[0] - ts) / 1e9)
            lats.append((resp[-1] - ts) / 1e9)
            itls.extend((b - a) / 1e9 for a, b in zip(resp, resp[1:]))
        window = exp.get("window_boundaries") or []
        dur = (window[-1] - window[0]) / 1e9 if len(window) >= 2 else float("nan")
        rows.append({
            "file": Path(path).name,
            "model": Path(path).name.split("_")[0],
            "mode": mode.get("mode"),
            "concurrency": mode.get("value"),
            "requests": len(lats),
            "throughput_rps": len(lats) / dur if dur and dur == dur and dur > 0 else float("nan"),
            "mean_latency_s": statistics.fmean(lats) if lats else float("nan"),
            "p50_ttft_s": percentile(ttfts, 50),
            "p95_ttft_s": percentile(ttfts, 95),
            "itl_p50_s": percentile(itls, 50),
            "itl_p95_s": percentile(itls, 95),
        })
    return rows


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def _cmd_run(args: argparse.Namespace) -> None:
    specs = make_workload(args.model_dir, args.num_requests, args.prompt_mean, args.gen_mean,
                          args.variance, args.seed, args.max_model_len)
    if args.target == "triton":
        driver: Driver = TritonDriver(args.url, args.model)
    else:
        driver = OpenAIDriver(args.url, args.model)
    print(f"[fastgen_bench] {args.label or args.target}: {len(specs)} requests, prompt mean "
          f"{args.prompt_mean} gen mean {args.gen_mean}")
    res = sweep(driver, specs, _parse_ints(args.clients), args.per_client, args.min_requests,
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
    r.add_argument("--target", choices=("triton", "openai"), required=True)
    r.add_argument("--url", required=True, help="host:grpc_port (triton) or http://host:port (openai)")
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
