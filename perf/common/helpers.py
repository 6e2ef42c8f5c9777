"""Small helpers every group uses: NAME=VALUE options into a dict, and rows of dicts into a CSV file."""

from __future__ import annotations

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
