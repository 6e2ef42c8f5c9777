"""perf_analyzer's side of the FastGen workload: its --input-data file and a summary of its
per-request profile exports (used by perf_analyzer.sh)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.served.fastgen_metrics import percentile
from perf.common.workload import RequestSpec

def write_pa_input(specs: Sequence[RequestSpec], path: str, extra: dict | None = None) -> None:
    """perf_analyzer --input-data JSON: one entry per request (shape [1] per tensor, batch 1)."""
    data = []
    for s in specs:
        entry = {
            "text_input": {"content": [s.prompt], "shape": [1]},
            "max_tokens": {"content": [s.gen_tokens], "shape": [1]},
            "stream": {"content": [True], "shape": [1]},
            "ignore_eos": {"content": [True], "shape": [1]},
        }
        if extra:
            entry.update(extra)
        data.append(entry)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"data": data}, ensure_ascii=False, indent=1))


def summarize_pa_profile(path: str) -> list[dict]:
    """Rows from a perf_analyzer --profile-export-file: per concurrency level, TTFT / ITL / latency."""
    doc = json.loads(Path(path).read_text())
    rows = []
    for exp in doc.get("experiments", []):
        mode = exp.get("experiment", {})
        reqs = exp.get("requests", [])
        ttfts, itls, lats = [], [], []
        for r in reqs:
            ts = r.get("timestamp")
            resp = r.get("response_timestamps") or []
            if ts is None or not resp:
                continue
            # Last response may be the empty final one; timestamps are ns.
            ttfts.append((resp[0] - ts) / 1e9)
            lats.append((resp[-1] - ts) / 1e9)
            itls.extend((b - a) / 1e9 for a, b in zip(resp, resp[1:]))
        window = exp.get("window_boundaries") or []
        dur = (window[-1] - window[0]) / 1e9 if len(window) >= 2 else float("nan")
        rows.append({
            "file": Path(path).name,
            "model": Path(path).name.split("_")[0],
            "mode": mode.get("mode"),
            "concurrency": mode.get("value"),
            "requests": len(lats),
            "throughput_rps": len(lats) / dur if dur and dur == dur and dur > 0 else float("nan"),
            "mean_latency_s": statistics.fmean(lats) if lats else float("nan"),
            "p50_ttft_s": percentile(ttfts, 50),
            "p95_ttft_s": percentile(ttfts, 95),
            "itl_p50_s": percentile(itls, 50),
            "itl_p95_s": percentile(itls, 95),
        })
    return rows
