"""The counts behind the floors (perf/roofline.py, used by offline_compare.py and run_all.py): the
decode share of the attention FLOPs and the K/V bytes the decodes read, against a token-by-token
count, and how a floor adds them up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import roofline as oc  # noqa: E402


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


def test_floor_is_matmuls_at_the_peak_plus_decode_reads_at_the_read_rate(model_dir):
    lengths = [(9, 6), (4, 1)]
    peak, read = 100.0, 10.0  # GFLOP/s, GB/s
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        floor, kv_gb = oc.floor_seconds(model_dir, lengths, dtype, peak, read)
        flops = sum(oc.flops_per_request(model_dir, p, g) - oc.decode_attention_flops(model_dir, p, g)
                    for p, g in lengths)
        want_kv = oc.decode_kv_bytes(model_dir, 9, 6, itemsize) / 1e9  # (4, 1) decodes nothing
        assert kv_gb == pytest.approx(want_kv)
        assert floor == pytest.approx(flops / 1e9 / peak + want_kv / read)
    # Halving the peak doubles the matmul part only.
    f1, kv = oc.floor_seconds(model_dir, lengths, "float32", peak, read)
    f2, _ = oc.floor_seconds(model_dir, lengths, "float32", peak / 2, read)
    assert f2 - f1 == pytest.approx(f1 - kv / read)


def test_remeasured_keeps_the_better_figure_of_each(monkeypatch):
    # A rate disturbed by another process comes out low: each figure keeps the better of the two
    # measurements, dtype by dtype.
    rates = iter([(100.0, 300.0, 20.0), (120.0, 250.0, 15.0)])  # (fp32, bf16, read) before, after

    def measure_once(threads, dtypes):
        fp32, bf16, read = next(rates)
        return oc.Roofline(threads, {"float32": fp32, "bfloat16": bf16}, read)

    monkeypatch.setattr(oc.Roofline, "measure", classmethod(lambda cls, threads, dtypes: measure_once(threads, dtypes)))
    roof = oc.Roofline.measure(2, ["float32", "bfloat16"]).remeasured()
    assert roof == oc.Roofline(2, {"float32": 120.0, "bfloat16": 300.0}, 20.0)


def test_measure_runs_in_a_child_process(monkeypatch):
    # Measured here, the GEMMs would leave an OpenMP pool on this thread that throttles an engine
    # stepped later on another thread of this process (run_all's in-process systems).
    def not_here(*args, **kwargs):
        raise AssertionError("the roofline was measured in the calling process")

    monkeypatch.setattr(oc, "gemm_peak_gflops", not_here)
    monkeypatch.setattr(oc, "read_bandwidth_gbs", not_here)
    roof = oc.Roofline.measure(1, ["float32"])
    assert roof.threads == 1 and set(roof.gemm_peak_gflops) == {"float32"}
    assert roof.gemm_peak_gflops["float32"] > 0 and roof.read_gbs > 0
