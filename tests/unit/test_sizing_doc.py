"""docs/sizing.md's tables are the output of splitfuse.tools.sizing, and that arithmetic holds the
figures the docs quote (Llama-3.1-8B: 8.03 B parameters, 16.06 GB in bf16, 128 KiB of bf16 KV a
token: 8,192 tokens in the default 1 GiB pool; Llama-2-7B in fp32: 1 MiB a token, 1,024)."""

from __future__ import annotations

from pathlib import Path

from splitfuse.tools.sizing import LLAMA_2_7B, LLAMA_31_8B, LLAMA_32_1B, kv_table, weight_bytes, weights_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "sizing.md"


def test_the_doc_holds_the_scripts_tables():
    text = DOC.read_text()
    assert weights_table() in text and kv_table() in text


def test_the_arithmetic_against_the_published_sizes():
    assert round(LLAMA_31_8B.params() / 1e9, 2) == 8.03 and round(LLAMA_32_1B.params() / 1e9, 2) == 1.24
    assert round(weight_bytes(LLAMA_31_8B, "bf16") / 1e9, 2) == 16.06  # its safetensors files' size
    assert LLAMA_31_8B.kv_bytes_per_token(2) == 128 << 10 and (1 << 30) // (128 << 10) == 8192
    assert LLAMA_2_7B.kv_bytes_per_token(4) == 1 << 20
