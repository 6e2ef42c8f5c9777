"""The FastGen metrics and SLA math of perf/served/fastgen_metrics.py, on synthetic arrival times."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `perf` is a package

from perf.served import fastgen_metrics as fm  # noqa: E402
from perf.common import workload  # noqa: E402


def rec(start, arrivals, prompt=512, gen=None, idx=0, error=None):
    """A record whose tokens arrive at `start + a` for each a in arrivals (one token each), or
    (a, n) pairs for responses carrying n tokens."""
    chunks = [(start + a, 1) if not isinstance(a, tuple) else (start + a[0], a[1]) for a in arrivals]
    n = sum(c[1] for c in chunks)
    end = chunks[-1][0] if chunks else start
    return fm.RequestRecord(idx=idx, client=0, prompt_tokens=prompt, gen_tokens=gen if gen is not None else n,
                            start=start, end=end, chunks=chunks, error=error)


def test_token_gen_times_single_token_chunks():
    r = rec(10.0, [0.5, 0.6, 0.8, 1.1])
    assert fm.token_gen_times(r) == pytest.approx([0.5, 0.1, 0.2, 0.3])
    assert fm.ttft(r) == pytest.approx(0.5)


def test_token_gen_times_multi_token_chunks_split_evenly():
    # First response carries 2 tokens (the 2nd arrives with the first), then 3 tokens after 0.3 s.
    r = rec(0.0, [(0.4, 2), (0.7, 3)])
    assert fm.token_gen_times(r) == pytest.approx([0.4, 0.0, 0.1, 0.1, 0.1])
    assert r.output_tokens == 5


def test_token_gen_times_ignores_empty_responses():
    r = rec(0.0, [(0.2, 0), (0.5, 1), (0.6, 1), (0.6, 0)])
    assert fm.token_gen_times(r) == pytest.approx([0.5, 0.1])
    assert fm.ttft(r) == pytest.approx(0.5)


def test_ema_matches_pandas_adjust_true_closed_form():
    xs = [1.0, 2.0, 3.0, 4.0]
    a = 2.0 / 17.0
    expect = []
    for t in range(len(xs)):
        w = [(1 - a) ** (t - i) for i in range(t + 1)]
        expect.append(sum(wi * x for wi, x in zip(w, xs)) / sum(w))
    assert fm.ema(xs, span=16) == pytest.approx(expect)
    # span=1 -> alpha=1: no smoothing
    assert fm.ema(xs, span=1) == pytest.approx(xs)
    # constant series stays constant
    assert fm.ema([0.3] * 50) == pytest.approx([0.3] * 50)


def test_ema_of_one_spike_among_fast_tokens():
    # One 1 s stall after 30 tokens at 50 ms: EMA jumps to about 0.05 + 0.95 * 2/17 ~= 0.162.
    xs = [0.05] * 30 + [1.0] + [0.05] * 5
    e = fm.ema(xs, span=16)
    a = 2 / 17
    w_last = 1.0 / sum((1 - a) ** i for i in range(31))
    assert e[30] == pytest.approx(0.05 + 0.95 * w_last)
    assert max(e) == pytest.approx(e[30])


def test_meets_sla_prompt_deadline():
    # 512-token prompt: first token due within 1.0 s.
    ok = rec(0.0, [0.99] + [0.99 + 0.1 * i for i in range(1, 10)], prompt=512)
    late = rec(0.0, [1.01] + [1.01 + 0.1 * i for i in range(1, 10)], prompt=512)
    assert fm.meets_sla(ok, 4.0)
    assert not fm.meets_sla(late, 4.0)
    # 1024 tokens -> 2 s allowance
    assert fm.meets_sla(rec(0.0, [1.9, 2.0], prompt=1024), 4.0)


def test_meets_sla_generation_rate_thresholds():
    # Steady 0.2 s gaps = 5 tok/s: meets 2 and 4 tok/s, fails 6 tok/s (needs < 0.1667 s).
    r = rec(0.0, [0.5 + 0.2 * i for i in range(20)], prompt=512)
    assert fm.meets_sla(r, 2.0)
    assert fm.meets_sla(r, 4.0)
    assert not fm.meets_sla(r, 6.0)
    # Exactly at the threshold fails (strict <, as in the FastGen scripts).
    r = rec(0.0, [0.5 + 0.25 * i for i in range(10)], prompt=512)
    assert not fm.meets_sla(r, 4.0)


def test_meets_sla_stall_fails_only_the_strict_slas():
    # 50 ms tokens with one 2 s stall after 20: EMA peaks at 0.05 + 1.95 * 0.127 ~= 0.30 s:
    # fails 6 and 4 tok/s, meets 2 tok/s.
    gaps = [0.05] * 20 + [2.0] + [0.05] * 20
    arrivals, t = [0.3], 0.3
    for g in gaps:
        t += g
        arrivals.append(t)
    r = rec(0.0, arrivals, prompt=512)
    peak = max(fm.ema(gaps))
    assert 0.25 < peak < 0.5
    assert fm.meets_sla(r, 2.0)
    assert not fm.meets_sla(r, 4.0)
    assert not fm.meets_sla(r, 6.0)


def test_meets_sla_errors_and_single_token():
    assert not fm.meets_sla(rec(0.0, [0.1, 0.2], error="boom"), 2.0)
    assert not fm.meets_sla(rec(0.0, []), 2.0)
    assert fm.meets_sla(rec(0.0, [0.1], prompt=100), 6.0)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    xs = [rng.random() for _ in range(101)]
    for q in (0, 50, 90, 95, 99, 100):
        assert fm.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert fm.percentile([3.0], 95) == 3.0
    assert math.isnan(fm.percentile([], 50))


def test_summarize_known_answers():
    # Four requests over 0..5.2 s; request 2 has a late first token, request 3 one stall.
    r3_arrivals = [0.4 + 0.1 * i for i in range(21)] + [2.4 + 1.5, 2.4 + 1.6]
    records = [
        rec(0.0, [0.5, 0.6, 0.7, 0.8], prompt=512, idx=0),       # 10 tok/s: meets every SLA
        rec(0.0, [0.5, 0.7, 0.9, 1.1], prompt=512, idx=1),       # 5 tok/s: meets @2, @4; fails @6
        rec(1.0, [0.8, 0.9, 1.0, 1.1], prompt=256, idx=2),       # TTFT 0.8 s > 256/512 s: fails all
        rec(1.2, r3_arrivals, prompt=512, idx=3),                 # 1.5 s stall: EMA peak ~0.28 s: @2 only
    ]
    a = 2 / 17
    peak = 0.1 + 1.4 / sum((1 - a) ** i for i in range(21))
    assert max(fm.ema(fm.token_gen_times(records[3])[1:])) == pytest.approx(peak)
    assert 0.25 < peak < 0.5
    m = fm.summarize(records)
    assert m["completed"] == 4 and m["errors"] == 0
    assert m["duration_s"] == pytest.approx(5.2)  # first start 0.0, last end 1.2 + 4.0
    assert m["throughput_rps"] == pytest.approx(4 / 5.2)
    assert m["mean_latency_s"] == pytest.approx((0.8 + 1.1 + 1.1 + 4.0) / 4)
    assert m["mean_ttft_s"] == pytest.approx((0.5 + 0.5 + 0.8 + 0.4) / 4)
    assert m["ttft_sla_ok_frac"] == pytest.approx(3 / 4)
    assert m["sla_ok_frac@2"] == pytest.approx(3 / 4)
    assert m["sla_ok_frac@4"] == pytest.approx(2 / 4)
    assert m["sla_ok_frac@6"] == pytest.approx(1 / 4)
    assert m["effective_rps@2"] == pytest.approx(4 / 5.2 * 3 / 4)
    assert m["effective_rps@4"] == pytest.approx(4 / 5.2 * 2 / 4)
    assert m["effective_rps@6"] == pytest.approx(4 / 5.2 * 1 / 4)
    gaps = [0.1] * 3 + [0.2] * 3 + [0.1] * 3 + [0.1] * 20 + [1.5, 0.1]
    assert m["token_latency_p50_s"] == pytest.approx(fm.percentile(gaps, 50))
    assert m["token_latency_p90_s"] == pytest.approx(fm.percentile(gaps, 90))
    assert m["token_latency_p95_s"] == pytest.approx(fm.percentile(gaps, 95))
    assert m["token_latency_p50_s"] == pytest.approx(0.1)
    assert m["token_latency_p95_s"] == pytest.approx(0.2)
    assert m["length_mismatches"] == 0


def test_summarize_counts_errors_against_effective_throughput():
    good = rec(0.0, [0.1, 0.2], prompt=512, idx=0)
    bad = rec(0.0, [0.1], prompt=512, idx=1, error="timeout")
    m = fm.summarize([good, bad])
    assert m["completed"] == 1 and m["errors"] == 1
    assert m["throughput_rps"] == pytest.approx(1 / 0.2)
    assert m["effective_rps@4"] == pytest.approx(1 / 0.2 * 0.5)
    assert fm.summarize([bad])["completed"] == 0


def test_draw_lengths_normal_with_30_percent_sd():
    rng = random.Random(1)
    xs = workload.draw_lengths(4000, 200, 0.3, 1, 10_000, rng)
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
    assert mean == pytest.approx(200, rel=0.03)
    assert sd == pytest.approx(60, rel=0.06)
    assert min(workload.draw_lengths(100, 10, 2.0, 3, 12, rng)) >= 3
    assert max(workload.draw_lengths(100, 10, 2.0, 3, 12, rng)) <= 12


def test_record_json_round_trip():
    r = rec(1.0, [(1.5, 2), (1.7, 1)], prompt=7, idx=3)
    r.server_prompt_tokens = 7
    back = fm.RequestRecord.from_json(r.to_json())
    assert back == r
