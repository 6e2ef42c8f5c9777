"""A benchmark's result as a JSON file that says which machine, commit and command made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from perf.common.machine import cpu_flags, cpu_model, git_commit


def write_result(folder: Path, name: str, result: dict) -> Path:
    """`result`, with the machine, commit and command added, as `folder/name.json`."""
    result.update({"machine": {"cpu": cpu_model(), "cpu_flags": cpu_flags()}, "commit": git_commit(),
                   "command": " ".join([Path(sys.executable).name, *sys.argv])})
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out
