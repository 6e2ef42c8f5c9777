"""genai-perf (NVIDIA's LLM benchmark client) profiles the real server as a user would run it:
perf/load/genai_perf_sweep.py on a tiny workload, every request succeeding. Skips, saying how to set
it up, when perf/load/setup_genai_perf.sh has not been run (genai-perf lives in its own venv)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from triton_helpers import metric_sum, wait_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root: `perf` is a package

from perf.load import genai_perf_sweep  # noqa: E402

pytestmark = pytest.mark.serving


def test_genai_perf_sweep_on_a_tiny_workload(served, tmp_path, monkeypatch):
    why = genai_perf_sweep.missing_tools()
    if why:
        pytest.skip(f"genai-perf is not set up: {why}")
    # perf_analyzer reads the model config, which the server opens only with the admin header.
    monkeypatch.setenv(genai_perf_sweep.ADMIN_KEY_ENV, served.admin_key)
    generated_before = metric_sum(served.metrics_url, "splitfuse_generation_tokens_total")
    out = tmp_path / "genai-perf"
    code = genai_perf_sweep.main(["--grpc-url", served.grpc_url, "--model-dir", served.model_dir, "--levels", "1,2",
                                  "--per-level", "2", "--min-requests", "3", "--prompt-mean", "24",
                                  "--gen-mean", "6", "--num-prompts", "6", "--out", str(out)])
    logs = {p.name: p.read_text()[-1500:] for p in (out / "logs").glob("*.log")}
    assert code == 0, logs
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for r in rows:
        assert int(r["exit_code"]) == 0
        # every request perf_analyzer counted came back: as many measured as were sent
        assert float(r["requests_measured"]) == int(r["requests_sent"]) == max(3, 2 * int(r["concurrency"]))
        assert float(r["request_throughput_rps"]) > 0 and float(r["ttft_p50_ms"]) > 0
        assert 10 < float(r["input_tokens_avg"]) < 40
    # The requests reached the engine, each generating exactly its max_tokens (min_length too).
    expected = 0
    for run in json.loads((out / "meta.json").read_text())["runs"]:
        entries = json.loads((out / run["artifact_dir"] / "inputs.json").read_text())["data"]
        assert all(e["min_length"] == e["max_tokens"] and e["ignore_eos"] == [True] for e in entries)
        expected += run["requests"] * min(e["max_tokens"][0] for e in entries)
    # (metrics are published about every half second)
    assert wait_for(lambda: metric_sum(served.metrics_url, "splitfuse_generation_tokens_total")
                    - generated_before >= expected, timeout=10.0)
    assert (out / "sweep.png").stat().st_size > 5000
    summary = (out / "summary.md").read_text()
    assert "genai-perf profile -m ensemble" in summary and served.admin_key not in summary
