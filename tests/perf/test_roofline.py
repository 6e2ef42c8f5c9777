"""The counts behind the floors (perf/common/roofline.py, used by offline_compare.py and run_all.py): the
decode share of the attention FLOPs and the K/V bytes the decodes read, against a token-by-token
count; how the strict and additive floors combine them; and the record of the best rates seen on a
machine, which keeps one noisy run from lowering a floor."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root: `perf` is a package

from perf.common import roofline as oc  # noqa: E402


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


def test_floor_parts_are_matmuls_at_the_peak_and_decode_reads_at_the_read_rate(model_dir):
    lengths = [(9, 6), (4, 1)]
    peak, read = 100.0, 10.0  # GFLOP/s, GB/s
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        fl = oc.workload_floor(model_dir, lengths, dtype, peak, read)
        flops = sum(oc.flops_per_request(model_dir, p, g) - oc.decode_attention_flops(model_dir, p, g)
                    for p, g in lengths)
        want_kv = oc.decode_kv_bytes(model_dir, 9, 6, itemsize) / 1e9  # (4, 1) decodes nothing
        assert fl.kv_gb == pytest.approx(want_kv)
        assert fl.compute_s == pytest.approx(flops / 1e9 / peak)
        assert fl.memory_s == pytest.approx(want_kv / read)
    # Halving the peak doubles the matmul part only.
    f1 = oc.workload_floor(model_dir, lengths, "float32", peak, read)
    f2 = oc.workload_floor(model_dir, lengths, "float32", peak / 2, read)
    assert f2.compute_s == pytest.approx(2 * f1.compute_s) and f2.memory_s == f1.memory_s


@pytest.mark.parametrize("peak, read", [(100.0, 10.0), (1e6, 1e-3), (1e-3, 1e6)])
def test_strict_floor_is_the_larger_part_and_the_additive_their_sum(model_dir, peak, read):
    # Compute-bound, memory-bound and mixed: the strict floor is the slower part, never above the sum.
    fl = oc.workload_floor(model_dir, [(9, 6), (30, 12)], "float32", peak, read)
    assert fl.compute_s > 0 and fl.memory_s > 0
    assert fl.strict_s == max(fl.compute_s, fl.memory_s)
    assert fl.additive_s == pytest.approx(fl.compute_s + fl.memory_s)
    assert fl.strict_s < fl.additive_s
    assert oc.Floor(2.0, 3.0, 1.0).as_dict() == {"strict_s": 3.0, "additive_s": 5.0, "compute_s": 2.0,
                                                  "memory_s": 3.0, "decode_kv_gb": 1.0}


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


# ------------------------------------------------------------------ the record of the best rates
@pytest.fixture
def machine(monkeypatch):
    """A fake CPU (what machine_key reads), switchable by the test; a fixed commit."""
    cpu = {"model": "Test CPU (family 1, model 2)", "flags": ["avx2", "fma"]}
    monkeypatch.setattr(oc, "cpu_model", lambda: cpu["model"])
    monkeypatch.setattr(oc, "cpu_flags", lambda: list(cpu["flags"]))
    monkeypatch.setattr(oc, "git_commit", lambda: "abc1234")
    return cpu


def roof(fp32: float, bf16: float, read: float, threads: int = 2) -> oc.Roofline:
    return oc.Roofline(threads, {"float32": fp32, "bfloat16": bf16}, read)


def test_record_raises_a_low_measurement_and_records_a_better_one(machine, tmp_path):
    path = tmp_path / "machine_peaks.json"
    with pytest.warns(UserWarning, match="no record"):
        first = roof(200.0, 400.0, 50.0).with_record(path)
    assert (first.gemm_peak_gflops, first.read_gbs, first.from_record) == ({"float32": 200.0, "bfloat16": 400.0},
                                                                           50.0, {})
    # A noisy run (bf16 and read low, fp32 better): each figure is the better of run and record.
    second = roof(210.0, 300.0, 30.0).with_record(path)
    assert second.gemm_peak_gflops == {"float32": 210.0, "bfloat16": 400.0} and second.read_gbs == 50.0
    assert set(second.from_record) == {"gemm_peak_gflops.bfloat16", "read_gbs"}
    assert second.from_record["read_gbs"]["value"] == 50.0 and second.from_record["read_gbs"]["commit"] == "abc1234"
    assert second.measured == {"gemm_peak_gflops": {"float32": 210.0, "bfloat16": 300.0}, "read_gbs": 30.0}
    report = second.as_dict()
    assert report["from_record"] == second.from_record and report["measured"] == second.measured
    assert report["record_key"] == oc.machine_key(2) and "Test CPU" in report["record_key"]
    # Only the better fp32 peak was recorded; the rest keeps the first run's figures.
    entry = json.loads(path.read_text())["machines"][oc.machine_key(2)]
    assert entry["gemm_peak_gflops"]["float32"]["value"] == 210.0
    assert entry["gemm_peak_gflops"]["bfloat16"]["value"] == 400.0 and entry["read_gbs"]["value"] == 50.0
    assert entry["cpu"] == machine["model"] and entry["threads"] == 2
    assert {"date", "commit"} <= set(entry["read_gbs"])
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_floor_from_the_record_does_not_drop_with_a_noisy_run(machine, model_dir, tmp_path):
    path = tmp_path / "machine_peaks.json"
    lengths = [(30, 12)] * 4
    with pytest.warns(UserWarning):
        good = roof(200.0, 400.0, 50.0).with_record(path)
    noisy = roof(100.0, 200.0, 20.0).with_record(path)
    for d in ("float32", "bfloat16"):
        assert (oc.workload_floor(model_dir, lengths, d, noisy.gemm_peak_gflops[d], noisy.read_gbs)
                == oc.workload_floor(model_dir, lengths, d, good.gemm_peak_gflops[d], good.read_gbs))


def test_record_is_kept_per_cpu_and_thread_count(machine, tmp_path):
    path = tmp_path / "machine_peaks.json"
    with pytest.warns(UserWarning):
        roof(500.0, 1000.0, 80.0).with_record(path)
    # Fewer threads, another CPU, or the same name with other SIMD flags: the record does not apply.
    one_thread = roof(100.0, 200.0, 20.0, threads=1).with_record(path)
    assert one_thread.from_record == {} and one_thread.read_gbs == 20.0
    machine["model"] = "Other CPU (family 3, model 4)"
    other = roof(100.0, 200.0, 20.0).with_record(path)
    assert other.from_record == {} and other.gemm_peak_gflops["float32"] == 100.0
    machine["model"], machine["flags"] = "Test CPU (family 1, model 2)", ["avx2", "avx512f", "fma"]
    assert roof(100.0, 200.0, 20.0).with_record(path).from_record == {}
    machines = json.loads(path.read_text())["machines"]
    assert len(machines) == 4
    machine["flags"] = ["avx2", "fma"]
    assert roof(100.0, 200.0, 20.0).with_record(path).read_gbs == 80.0  # the first one is still there


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"machines": 3}', ""])
def test_corrupt_record_is_ignored_with_a_warning_and_rewritten(machine, tmp_path, content):
    path = tmp_path / "machine_peaks.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring"):
        r = roof(200.0, 400.0, 50.0).with_record(path)
    assert r.from_record == {} and r.read_gbs == 50.0
    doc = json.loads(path.read_text())
    assert doc["machines"][oc.machine_key(2)]["read_gbs"]["value"] == 50.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a well-formed record raises no warning
        assert roof(100.0, 100.0, 10.0).with_record(path).read_gbs == 50.0


def test_malformed_figure_on_record_is_ignored_and_replaced(machine, tmp_path):
    path = tmp_path / "machine_peaks.json"
    entry = {"gemm_peak_gflops": {"float32": {"value": "fast"}, "bfloat16": {"value": 900.0, "date": "d",
                                                                              "commit": "c"}},
             "read_gbs": {"value": float("nan")}}
    path.write_text(json.dumps({"machines": {oc.machine_key(2): entry}}))
    with pytest.warns(UserWarning, match="malformed"):
        r = roof(200.0, 400.0, 50.0).with_record(path)
    assert r.gemm_peak_gflops == {"float32": 200.0, "bfloat16": 900.0} and r.read_gbs == 50.0
    assert set(r.from_record) == {"gemm_peak_gflops.bfloat16"}
    saved = json.loads(path.read_text())["machines"][oc.machine_key(2)]
    assert saved["gemm_peak_gflops"]["float32"]["value"] == 200.0 and saved["read_gbs"]["value"] == 50.0


def test_report_gives_each_system_its_share_of_both_floors_and_names_the_recorded_rates():
    from perf.served import fastgen_report

    machine = {"cpu": "Test CPU (family 1, model 2)", "cpu_flags": "avx2 fma"}
    best = {"vllm_2c": {"max_throughput": 2.0}, "vllm_2c:bf16": {"max_throughput": 3.0}}
    meta = {"machine": machine, "roofline": {
        "threads": 2, "gemm_peak_gflops": {"float32": 500.0, "bfloat16": 1000.0}, "read_gbs": 80.0,
        "measured": {"gemm_peak_gflops": {"float32": 500.0, "bfloat16": 900.0}, "read_gbs": 80.0},
        "from_record": {"gemm_peak_gflops.bfloat16": {"value": 1000.0, "date": "2026-11-26", "commit": "c0ffee1"}},
        "record_file": "perf/results/machine_peaks.json",
        "floors": {"float32": {"strict_rps": 8.0, "additive_rps": 5.0},
                   "bfloat16": {"strict_rps": 12.0, "additive_rps": 10.0}}}}
    text = "\n".join(fastgen_report._roofline_lines(best, meta))
    assert "Test CPU (family 1, model 2) (flags: avx2 fma)" in text
    assert "bfloat16 1000 GFLOP/s from the record (2026-11-26, c0ffee1; this run 900)" in text
    assert "float32 500 GFLOP/s (this run)" in text
    assert "| 2.000 | 8.000 | 0.25 | 5.000 | 0.40 |" in text  # fp32 vLLM: strict share, additive share
    assert "| 3.000 | 12.000 | 0.25 | 10.000 | 0.30 |" in text
    # A run from before the strict floor (additive `floor_rps` only): the strict columns stay empty.
    old = {"machine": machine, "roofline": {"threads": 2, "gemm_peak_gflops": {"float32": 500.0}, "read_gbs": 80.0,
                                            "floor_rps": {"float32": 5.0}}}
    text = "\n".join(fastgen_report._roofline_lines(best, old))
    assert "| 2.000 | - | - | 5.000 | 0.40 |" in text and "from the record" not in text
