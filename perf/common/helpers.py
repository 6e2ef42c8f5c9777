"""Small helpers every group uses: NAME=VALUE options into a dict, rows of dicts into a CSV file,
and the output options of the served benchmarks."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Iterable

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))


def name_values(items: Iterable[str]) -> dict[str, str]:
    """`NAME=VALUE` items (repeated `--param` / `--vllm-env` options) as a dict, later items
    winning; an item without `=` is NAME with an empty value."""
    out: dict[str, str] = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = value
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    """`rows` as a CSV file, the columns every key in the order first seen."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def add_output_options(ap: argparse.ArgumentParser, out: Path, workdir: Path) -> None:
    """What a served benchmark writes where: --out (results), --workdir (model repositories, logs),
    --note (lines for the summary) and --report-only (render a finished run's results again)."""
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--workdir", default=str(workdir))
    ap.add_argument("--note", action="append", default=[], help="line added to the summary's run notes")
    ap.add_argument("--report-only", action="store_true")
