"""FastGen's metrics: per-request records, token timings, the SLA and effective throughput.

* Throughput (requests/s) = completed requests / (last end - first start); latency = mean
  end-to-end request time.
* Effective throughput = throughput x share of requests meeting the SLA: first token within
  |prompt tokens| / 512 s, and the exponential moving average (span 16, pandas `ewm(span=16)`
  with its default `adjust=True` weighting, as the FastGen scripts use) of every later
  inter-token gap below 1/R s for R = 2, 4, 6 tokens/s.
* Token latency: P50/P90/P95 of the gaps between consecutive tokens (the first token is excluded:
  it is the time to first token, reported separately). When one streamed response carries k > 1
  tokens, its gap is split evenly over the k tokens (recorded as it arrived in the raw file).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

# --------------------------------------------------------------------------------------------
# Constants of the FastGen SLA
# --------------------------------------------------------------------------------------------
SLA_PROMPT_TOKENS_PER_S = 512.0
SLA_GEN_RATES = (2.0, 4.0, 6.0)
EMA_SPAN = 16

# --------------------------------------------------------------------------------------------
# Per-request records and the metrics
# --------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    idx: int
    client: int
    prompt_tokens: int
    gen_tokens: int
    start: float
    end: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, tokens in that streamed response), absolute perf_counter seconds."""
    error: str | None = None
    server_prompt_tokens: int | None = None
    server_output_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def latency(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        d = dict(d)
        d["chunks"] = [tuple(c) for c in d.get("chunks", [])]
        return cls(**d)


def token_gen_times(rec: RequestRecord) -> list[float]:
    """[time to first token, gap to token 2, gap to token 3, ...] (FastGen's token_gen_time).

    Streamed responses with no token (e.g. an empty final response) are ignored; a response with
    k tokens after a gap g contributes k gaps of g / k (the first token's share goes to TTFT).
    """
    out: list[float] = []
    prev = rec.start
    for t, n in rec.chunks:
        if n <= 0:
            continue
        if not out:
            # The first token's time is the whole wait for the first response (TTFT); tokens
            # that came with it arrived at the same moment.
            out.append(t - prev)
            out.extend([0.0] * (n - 1))
        else:
            out.extend([(t - prev) / n] * n)
        prev = t
    return out


def ttft(rec: RequestRecord) -> float | None:
    for t, n in rec.chunks:
        if n > 0:
            return t - rec.start
    return None


def ema(values: Sequence[float], span: int = EMA_SPAN) -> list[float]:
    """Exponential moving average like pandas `Series.ewm(span=span).mean()` (adjust=True).

    y_t = sum_{i<=t} (1-a)^(t-i) x_i / sum_{i<=t} (1-a)^(t-i),  a = 2 / (span + 1).
    """
    a = 2.0 / (span + 1.0)
    num = 0.0
    den = 0.0
    out = []
    for x in values:
        num = x + (1.0 - a) * num
        den = 1.0 + (1.0 - a) * den
        out.append(num / den)
    return out


def meets_sla(
    rec: RequestRecord,
    gen_rate: float,
    prompt_tps: float = SLA_PROMPT_TOKENS_PER_S,
    span: int = EMA_SPAN,
) -> bool:
    """FastGen's SLA: TTFT <= |prompt| / prompt_tps and EMA(inter-token gaps) < 1/gen_rate."""
    if not rec.ok:
        return False
    times = token_gen_times(rec)
    if not times:
        return False
    if times[0] > rec.prompt_tokens / prompt_tps:
        return False
    if len(times) == 1:
        return True
    return all(v < 1.0 / gen_rate for v in ema(times[1:], span))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    records: Sequence[RequestRecord],
    gen_rates: Iterable[float] = SLA_GEN_RATES,
    prompt_tps: float = SLA_PROMPT_TOKENS_PER_S,
    span: int = EMA_SPAN,
) -> dict:
    """Metrics of one load point (one system, one client count)."""
    done = [r for r in records if r.ok]
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
    }
    if not done:
        return out
    t0 = min(r.start for r in records)
    t1 = max(r.end for r in done)
    duration = t1 - t0
    thr = len(done) / duration if duration > 0 else float("nan")
    gaps = [g for r in done for g in token_gen_times(r)[1:]]
    ttfts = [x for x in (ttft(r) for r in done) if x is not None]
    out.update(
        duration_s=duration,
        throughput_rps=thr,
        output_tokens_per_s=sum(r.output_tokens for r in done) / duration if duration > 0 else float("nan"),
        mean_latency_s=statistics.fmean(r.latency for r in done),
        p50_latency_s=percentile([r.latency for r in done], 50),
        mean_ttft_s=statistics.fmean(ttfts) if ttfts else float("nan"),
        p50_ttft_s=percentile(ttfts, 50),
        p95_ttft_s=percentile(ttfts, 95),
        token_latency_p50_s=percentile(gaps, 50),
        token_latency_p90_s=percentile(gaps, 90),
        token_latency_p95_s=percentile(gaps, 95),
        token_latency_p99_s=percentile(gaps, 99),
        mean_prompt_tokens=statistics.fmean(r.prompt_tokens for r in done),
        mean_output_tokens=statistics.fmean(r.output_tokens for r in done),
        length_mismatches=sum(1 for r in done if r.output_tokens != r.gen_tokens),
        multi_token_chunks=sum(1 for r in done for _, n in r.chunks if n > 1),
        ttft_sla_ok_frac=sum(1 for r in done if (ttft(r) or 1e9) <= r.prompt_tokens / prompt_tps) / len(records),
    )
    for rate in gen_rates:
        ok = sum(1 for r in done if meets_sla(r, rate, prompt_tps, span))
        key = f"{rate:g}"
        out[f"sla_ok_frac@{key}"] = ok / len(records)
        out[f"effective_rps@{key}"] = thr * ok / len(records)
    return out
