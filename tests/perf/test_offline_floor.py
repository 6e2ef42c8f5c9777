"""The counts behind offline_compare.py's floors: the decode share of the attention FLOPs and the
K/V bytes the decodes read, against a token-by-token count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import offline_compare as oc  # noqa: E402


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_decode_kv_bytes_counts_each_decode_step_context(model_dir):
    prompt, gen = 7, 5
    # Decode steps make tokens 2..gen; the step making token i reads prompt + i - 1 cached tokens,
    # K and V, 2 KV heads x head_dim 16, in each of 3 layers.
    contexts = [prompt + i - 1 for i in range(2, gen + 1)]
    want = sum(contexts) * 2 * 3 * 2 * 16
    assert oc.decode_kv_bytes(model_dir, prompt, gen, 1) == want
    assert oc.decode_kv_bytes(model_dir, prompt, gen, 4) == 4 * want
    assert oc.decode_kv_bytes(model_dir, prompt, 1, 4) == 0  # the first token comes from the prompt's pass


def test_decode_attention_flops_is_the_generation_part_of_the_attention_term(model_dir):
    prompt, gen = 9, 6
    # flops_per_request = (weights + LM head) per generated token + the prompt's part + the
    # attention of the generated tokens, which decode_attention_flops is: removing it leaves a
    # total linear in the generated tokens.
    rest = [oc.flops_per_request(model_dir, prompt, g) - oc.decode_attention_flops(model_dir, prompt, g)
            for g in range(gen + 1)]
    steps = {round(b - a, 6) for a, b in zip(rest, rest[1:])}
    assert len(steps) == 1
    assert steps.pop() > 2 * 64 * 100  # more than the LM head alone
    assert 0 < oc.decode_attention_flops(model_dir, prompt, gen) < oc.flops_per_request(model_dir, prompt, gen)
