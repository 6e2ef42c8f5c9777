"""Every Prometheus family the backend registers has a row in docs/operations.md's metrics
table, and the table names none that the code does not register."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
METRICS_SOURCE = ROOT / "backend" / "triton_server" / "metrics.py"
NAME = re.compile(r"\bsplitfuse_[a-z_]+\b")


def _registered() -> set[str]:
    # Names appear as string literals: inline families and the STEP_COUNTERS / FAULT_GAUGES tables.
    return set(re.findall(r"\"(splitfuse_[a-z_]+)\"", METRICS_SOURCE.read_text()))


def _documented() -> set[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `splitfuse_")]
    return {name for row in rows for name in NAME.findall(row.split(" | ")[0])}


def test_the_metrics_table_lists_every_registered_metric():
    registered = _registered()
    assert len(registered) > 30  # the source was parsed, not an empty match
    assert registered - _documented() == set(), "metrics missing from docs/operations.md's table"


def test_the_metrics_table_lists_no_unknown_metric():
    assert _documented() - _registered() == set(), "docs/operations.md lists metrics the code does not register"
