"""First tokens in a load point's opening burst, from run_all.py's raw files.

    .venv/bin/python perf/served/burst_ttft.py --clients 16 perf/results/2026-11-28-served-smollm2-goodput

A closed-loop point starts all its clients at once, so its first requests arrive together; with
prompts of ~512 tokens and FastGen's first-token deadline of prompt / 512 s, a 2-core machine
cannot prefill them all in time, and those misses are most of the point's SLA misses. For each
system of each run folder (or raw .json.gz file) given, this prints the burst's requests (those
started within --window s of the point's first) meeting the first-token deadline and those
meeting the whole SLA at --gen-rate, the later requests meeting the SLA, and the burst's
first-token times (mean, median, max), then each burst request's prompt length and first-token time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.served.fastgen_metrics import SLA_PROMPT_TOKENS_PER_S, RequestRecord, meets_sla, token_gen_times  # noqa: E402


def raw_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted((p / "raw").glob("*.json.gz"))
        elif p.name.endswith(".json.gz"):
            files.append(p)
        else:
            raise SystemExit(f"{p}: neither a run folder nor a raw .json.gz file")
    return files


def records(point: dict) -> list[RequestRecord]:
    names = RequestRecord.__dataclass_fields__
    return [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in point["records"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run folders (with raw/) or raw .json.gz files")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--window", type=float, default=0.1, help="seconds after the point's first start")
    ap.add_argument("--gen-rate", type=float, default=4.0, help="the SLA's generation rate (tokens/s)")
    args = ap.parse_args()
    for path in raw_files(args.paths):
        data = json.load(gzip.open(path))
        for point in data["points"]:
            if point.get("clients") != args.clients:
                continue
            recs = [r for r in records(point) if r.ok]
            t0 = min(r.start for r in recs)
            burst = sorted((r for r in recs if r.start - t0 < args.window), key=lambda r: r.prompt_tokens)
            later = [r for r in recs if r.start - t0 >= args.window]
            first = {r.idx: token_gen_times(r)[0] for r in burst}
            in_time = sum(first[r.idx] <= r.prompt_tokens / SLA_PROMPT_TOKENS_PER_S for r in burst)
            print(f"{path.parent.parent.name}/{path.name.removesuffix('.json.gz')}: burst {len(burst)}, "
                  f"first token in time {in_time}, SLA met {sum(meets_sla(r, args.gen_rate) for r in burst)}; "
                  f"later SLA met {sum(meets_sla(r, args.gen_rate) for r in later)}/{len(later)}; burst first "
                  f"token mean {statistics.fmean(first.values()):.2f} s, median "
                  f"{statistics.median(first.values()):.2f} s, max {max(first.values()):.2f} s")
            print("   " + " ".join(f"{r.prompt_tokens}:{first[r.idx]:.2f}" for r in burst))


if __name__ == "__main__":
    main()
