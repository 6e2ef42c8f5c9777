#!/usr/bin/env python
"""Perplexity of each precision the engine offers, on a fixed English text every Python has.

The text is the Python reference manual's topics (`pydoc_data.topics`, ~700 KB of prose and
code), joined in key order; its first --tokens tokens are cut into windows of --window tokens,
each scored from scratch. A window runs through the engine's own forward pass (paged KV cache,
the CPU kernels, the fused decoder where it runs) as one chunk: its first token as the prompt
and the rest as proposed tokens, the way speculative verification runs them, so every row's
logits come back. transformers' fp32 model scores the same windows as the reference.

Beside each precision: the greedy agreement with our fp32 (share of 16 chat prompts whose first
--agree-tokens tokens are identical, and the mean length of the common prefix) and the offline
decode throughput (16 prompts, --gen-tokens tokens each).

    python perf/engine/perplexity.py --model models/smollm2-135m-instruct            # every precision
    python perf/engine/perplexity.py --model M --modes fp32,bf16 --tokens 4096        # a quick look

    python perf/engine/perplexity.py --model M --modes fp32,fp32-kv-bf16,fp32-kv-int8 --long-context 2048 \
        --out 2026-11-29-int8-kv                                                 # KV cache dtypes

--long-context N adds single-stream decode tokens/s after an N-token prompt, the median step
(what the KV cache's bytes per token weigh on most). Writes perf/results/<--out, default 2026-11-27-perplexity>/<name>.json
and .md with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS  # noqa: E402

from perf.common.machine import machine_info  # noqa: E402

from splitfuse import LLM, SamplingParams  # noqa: E402
from splitfuse.kernels.cpu.build import isa, library_isa  # noqa: E402
from splitfuse.engine.batch import RaggedBatch  # noqa: E402
from splitfuse.engine.scheduler import ScheduledChunk  # noqa: E402
from splitfuse.engine.sequence import Sequence  # noqa: E402

MODES: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "fp32-kv-bf16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
    # int8 codes with a float32 scale per token and kv head (C++ CPU attention only).
    "fp32-kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "bf16": {"dtype": "bfloat16"},
    "bf16-kv-int8": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int8-bf16": {"dtype": "bfloat16", "quantization": "int8"},
    # A checkpoint converted from a GGUF file: the file's own Q4_0/Q4_1/Q8_0 blocks.
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "gguf-exact": {"dtype": "float32", "quantization": "gguf-exact"},
    # Any float checkpoint: the projections quantized at load into GGUF blocks of that kind.
    **{q: {"dtype": "float32", "quantization": q} for q in ("q4_0", "q4_1", "q8_0")},
}
QUESTIONS = [
    "What is the capital of France?", "Say good morning in Spanish.", "Write a haiku about the sea.",
    "List three prime numbers.", "Explain in one sentence what a CPU does.", "Name a famous painter.",
    "What is 12 times 7?", "Give me a synonym for happy.", "Translate 'thank you' into French.",
    "What color is the sky on a clear day?", "Describe a cat in five words.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?", "Suggest a name for a pet fish.", "What is photosynthesis?",
    "Write one sentence about autumn.",
]


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def windows(token_ids: list[int], size: int, total: int) -> list[list[int]]:
    ids = token_ids[:total]
    return [ids[i:i + size] for i in range(0, len(ids) - 1, size) if len(ids[i:i + size]) > 1]


@torch.inference_mode()
def engine_nll(llm: LLM, window: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of window[1:] given what precedes each token, and its count."""
    engine = llm.engine
    seq = Sequence("perplexity", window[:1], SamplingParams(max_tokens=1), arrival=0, token_ids=list(window[:1]))
    seq.draft_token_ids = list(window[1:])
    engine.blocks.grow(seq, len(window))
    try:
        batch = RaggedBatch.build([ScheduledChunk(seq, 1, len(window) - 1)], engine.config.block_size,
                                  engine.runner.device)
        logits = engine.runner.execute(batch)  # float32 [len(window), V]: row i predicts window[i + 1]
    finally:
        engine.blocks.free(seq)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    target = torch.tensor(window[1:], dtype=torch.long)
    return -logp.gather(1, target[:, None]).sum().item(), len(window) - 1


def engine_perplexity(llm: LLM, chunks: list[list[int]]) -> tuple[float, int, float]:
    """The engine's perplexity over `chunks` (each scored alone), the tokens scored, and seconds taken."""
    t = time.perf_counter()
    nll, n = 0.0, 0
    for w in chunks:
        a, b = engine_nll(llm, w)
        nll, n = nll + a, n + b
    return math.exp(nll / n), n, time.perf_counter() - t


@torch.inference_mode()
def transformers_nll(model_dir: str, chunks: list[list[int]], **load) -> float:
    """transformers' fp32 perplexity over the windows; `load`: more from_pretrained arguments (gguf_file)."""
    from transformers import AutoModelForCausalLM

    from splitfuse.models.gguf_checkpoint import transformers_location

    if not load:  # a converted GGUF folder: transformers reads the file itself
        model_dir, load = transformers_location(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    nll, n = 0.0, 0
    for w in chunks:
        logits = model(torch.tensor([w])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        n += len(w) - 1
    return math.exp(nll / n)


def chat_prompts(llm: LLM) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def long_context_decode(llm: LLM, text_ids: list[int], context: int, gen_tokens: int) -> float:
    """Decode tokens/s of one sequence after a `context`-token prompt: the median engine step
    after the prompt's (robust to a busy machine's stalls)."""
    engine = llm.engine
    engine.add_request("long-context", text_ids[:context],
                       SamplingParams(max_tokens=gen_tokens + 1, temperature=0.0, ignore_eos=True))
    steps, decoding = [], False
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t)
        decoding = decoding or any(o.delta_token_ids for o in outs)  # the prompt's last chunk gave token 1
    return 1.0 / statistics.median(steps)


def measure(model: str, mode: str, chunks: list[list[int]], gen_tokens: int, agree_tokens: int,
            fp32_answers: list[list[int]] | None, threads: int, long_context: tuple[list[int], int] | None) -> dict:
    started = time.perf_counter()
    with LLM(model, num_threads=threads, **MODES[mode]) as llm:
        load_s = time.perf_counter() - started
        perplexity, n, score_s = engine_perplexity(llm, chunks)
        prompts = chat_prompts(llm)
        greedy = SamplingParams(max_tokens=agree_tokens, temperature=0.0)
        answers = [o.token_ids for o in llm.generate(prompts, greedy)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True))
        gen_s = time.perf_counter() - t
        long_tps = long_context_decode(llm, long_context[0], long_context[1], gen_tokens) if long_context else None
        runner = llm.engine.runner
        backends = {"linear": runner.linear_backend, "attention": runner.attention_backend,
                    "decoder_layers": runner.decoder_layers, "weights": runner.weight_memory_summary()}
    result = {"mode": mode, "settings": MODES[mode], "perplexity": perplexity, "tokens_scored": n,
              "scored_tokens_per_s": n / score_s, "decode_tokens_per_s": sum(len(o.token_ids) for o in outs) / gen_s,
              "load_s": load_s, "answers": answers, "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
              "kv_bytes_per_token": runner.kv_bytes_per_block() // runner.config.block_size, **backends}
    if long_context:
        result["long_context_decode_tokens_per_s"] = long_tps
    if fp32_answers is not None:
        same = [a[:agree_tokens] == b[:agree_tokens] for a, b in zip(answers, fp32_answers)]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(answers, fp32_answers)]
        result["agreement"] = {"identical": sum(same) / len(same), "mean_common_prefix": sum(prefix) / len(prefix)}
    return result


def markdown(meta: dict, rows: list[dict], reference_ppl: float | None) -> str:
    base = next((r["perplexity"] for r in rows if r["mode"] == "fp32"), None)
    lines = [f"# Perplexity: {meta['model']}", "",
             f"Text: pydoc_data.topics, {rows[0]['tokens_scored']} tokens scored in windows of {meta['window']}. "
             f"CPU: {meta['machine']['cpu']} ({meta['machine']['cpu_flags']}); kernels built for {meta['library_isa']}; "
             f"{meta['threads']} threads. Commit {meta['machine']['git_commit']}.", "",
             f"Command: `{meta['command']}`", ""]
    if reference_ppl is not None:
        lines += [f"transformers fp32 on the same windows: **{reference_ppl:.4f}**", ""]
    long = meta.get("long_context")
    lines += ["| mode | perplexity | vs fp32 | greedy = fp32 (first %d tokens) | common prefix (mean) | "
              "decode tok/s | %sscored tok/s | KV bytes/token | linear | decoder layers |"
              % (meta["agree_tokens"], f"1-stream decode tok/s at {long} | " if long else ""),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if long else "")]
    for r in rows:
        rel = f"{(r['perplexity'] / base - 1) * 100:+.2f}%" if base else ""
        agree = r.get("agreement")
        lines.append(f"| {r['mode']} | {r['perplexity']:.4f} | {rel} | "
                     + (f"{agree['identical'] * 100:.0f}% | {agree['mean_common_prefix']:.1f} | " if agree else "- | - | ")
                     + f"{r['decode_tokens_per_s']:.0f} | "
                     + (f"{r['long_context_decode_tokens_per_s']:.1f} | " if long else "")
                     + f"{r['scored_tokens_per_s']:.0f} | {r.get('kv_bytes_per_token', '-')} | {r['linear']} | "
                     f"{r['decoder_layers']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory or .gguf file")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="0: one per core")
    p.add_argument("--no-reference", action="store_true", help="skip transformers' fp32 perplexity")
    p.add_argument("--name", default=None, help="results file name (default: derived from the CPU and model)")
    p.add_argument("--out", default="2026-11-27-perplexity", help="results folder under perf/results")
    p.add_argument("--long-context", type=int, default=0,
                   help="also single-stream decode tokens/s after a prompt of this many tokens (0: not measured)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}")
    if "fp32" in modes:  # first: the others are compared with it
        modes = ["fp32"] + [m for m in modes if m != "fp32"]
    from transformers import AutoTokenizer

    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    model_dir = prepare_checkpoint(a.model)
    token_ids = AutoTokenizer.from_pretrained(model_dir)(reference_text())["input_ids"]
    if len(token_ids) < a.tokens:
        p.error(f"the text has {len(token_ids)} tokens, fewer than --tokens {a.tokens}")
    chunks = windows(token_ids, a.window, a.tokens)
    rows: list[dict] = []
    fp32_answers = None
    for mode in modes:
        try:
            row = measure(a.model, mode, chunks, a.gen_tokens, a.agree_tokens, fp32_answers, a.threads,
                          (token_ids, a.long_context) if a.long_context else None)
        except ValueError as e:  # a mode this CPU cannot run (e.g. the C++ int8 path)
            print(f"{mode}: not run here: {e}", file=sys.stderr)
            continue
        if mode == "fp32":
            fp32_answers = row["answers"]
        print(f"{mode}: perplexity {row['perplexity']:.4f}, decode {row['decode_tokens_per_s']:.0f} tok/s, "
              f"agreement {row.get('agreement')}", flush=True)
        rows.append(row)
    reference_ppl = None if a.no_reference else transformers_nll(model_dir, chunks)
    meta = {"model": a.model, "model_dir": model_dir, "window": a.window, "agree_tokens": a.agree_tokens,
            "long_context": a.long_context,
            "threads": a.threads or torch.get_num_threads(), "isa": isa(), "library_isa": library_isa(),
            "command": " ".join(["python", "perf/engine/perplexity.py", *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine_info()}
    out_dir = RESULTS / a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    name = a.name or f"{Path(model_dir).name}-{library_isa() or 'torch'}"
    for r in rows:
        r.pop("answers")
    (out_dir / f"{name}.json").write_text(json.dumps({**meta, "reference_perplexity": reference_ppl, "rows": rows},
                                                     indent=2))
    (out_dir / f"{name}.md").write_text(markdown(meta, rows, reference_ppl))
    print(markdown(meta, rows, reference_ppl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
