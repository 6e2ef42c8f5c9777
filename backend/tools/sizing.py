"""Sizing arithmetic for docs/sizing.md: weight bytes by precision and KV-cache bytes per token
for Llama shapes of 1B, 8B and 70B (and Llama-2-7B, the fp32 example), from the shapes in their
Hugging Face config.json files, written here so the tables are reproducible without a download.

    python -m splitfuse.tools.sizing        # prints the Markdown tables docs/sizing.md holds

tests/unit/test_sizing_doc.py checks that the doc's tables are this output.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_KV_GIB = 1.0  # EngineConfig.kv_cache_memory_gb's default
# Bits a weight in GGUF's blocks: 32 weights + an fp16 scale (Q8_0: 34 bytes, Q4_0: 18 bytes);
# Q4_K: 256 weights in 144 bytes.
Q8_0_BITS, Q4_0_BITS, Q4_K_BITS = 8.5, 4.5, 4.5


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    def projection_params(self) -> int:
        """q, k, v, o and the gate/up/down MLP of every layer: what quantization packs."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    def table_params(self) -> int:
        """The embedding and the LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    def params(self) -> int:
        return self.projection_params() + self.table_params() + self.norm_params()

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


# From each model's config.json (meta-llama on Hugging Face).
LLAMA_32_1B = Shape("Llama-3.2-1B", 16, 2048, 8192, 32, 8, 64, 128256, True)
LLAMA_31_8B = Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, False)
LLAMA_31_70B = Shape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, False)
LLAMA_2_7B = Shape("Llama-2-7B", 32, 4096, 11008, 32, 32, 128, 32000, False)
SHAPES = (LLAMA_32_1B, LLAMA_31_8B, LLAMA_31_70B)


def weight_bytes(shape: Shape, precision: str) -> float:
    """Bytes of weights held in memory when serving `shape` at `precision` (norms in float32)."""
    proj, table, norms = shape.projection_params(), shape.table_params(), 4 * shape.norm_params()
    per_weight = {  # (projections, embedding + LM head), bytes a weight
        "fp32": (4, 4), "bf16": (2, 2),
        "int8": (1, 2),  # int8 projections (one scale per output row, negligible), bf16 tables
        "q8_0": (Q8_0_BITS / 8, Q8_0_BITS / 8),
        "q4_0": (Q4_0_BITS / 8, Q8_0_BITS / 8),  # the tables in Q8_0 blocks
        "q4_K file": (Q4_K_BITS / 8, Q4_K_BITS / 8),  # on disk only: converted to float32 at start
    }[precision]
    return proj * per_weight[0] + table * per_weight[1] + norms


PRECISIONS = ("fp32", "bf16", "int8", "q8_0", "q4_0", "q4_K file")


def weights_table() -> str:
    rows = ["| model | parameters | " + " | ".join(PRECISIONS) + " |",
            "|---|---|" + "---|" * len(PRECISIONS)]
    for s in SHAPES:
        cells = [f"{weight_bytes(s, p) / GIB:.2f}" for p in PRECISIONS]
        rows.append(f"| {s.name} | {s.params() / 1e9:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def kv_table() -> str:
    rows = ["| model | layers x KV heads x head_dim | KV per token bf16 | KV per token fp32 | tokens in 1 GiB bf16 "
            "| tokens in 1 GiB fp32 | one 8k context bf16 | one 128k context bf16 |",
            "|---|---|---|---|---|---|---|---|"]
    for s in SHAPES + (LLAMA_2_7B,):
        bf16, fp32 = s.kv_bytes_per_token(2), s.kv_bytes_per_token(4)
        rows.append(f"| {s.name} | {s.layers} x {s.kv_heads} x {s.head_dim} | {bf16 // 1024} KiB | {fp32 // 1024} KiB "
                    f"| {int(DEFAULT_KV_GIB * GIB) // bf16:,} | {int(DEFAULT_KV_GIB * GIB) // fp32:,} "
                    f"| {8192 * bf16 / GIB:.2f} GiB | {131072 * bf16 / GIB:.1f} GiB |")
    return "\n".join(rows)


def main() -> None:
    print("Weights held in memory, GiB:\n")
    print(weights_table())
    print("\nKV cache:\n")
    print(kv_table())


if __name__ == "__main__":
    main()
