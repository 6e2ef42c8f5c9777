"""The options client_examples/README.md names (outside its genai-perf block) are ones the
script it names with them, or the launcher, accept."""

from __future__ import annotations

import re
from pathlib import Path

from splitfuse.launcher.cli import _parser

EXAMPLES = Path(__file__).resolve().parents[2] / "client_examples"
FLAG = r"--[a-z][a-z0-9-]*"


def _options(script: str) -> set[str]:
    return set(re.findall(rf"add_argument\(\"({FLAG})\"", (EXAMPLES / script).read_text()))


def _readme() -> str:
    return re.sub(r"```.*?```", "", (EXAMPLES / "README.md").read_text(), flags=re.S)


def test_script_and_option_pairs_exist():
    """`script.py --flag`: that script takes that flag."""
    pairs = re.findall(rf"`(\w+\.py) ({FLAG})", _readme())
    assert len(pairs) >= 5, "the README's format changed"
    assert [(s, f) for s, f in pairs if f not in _options(s)] == []


def test_table_rows_name_their_scripts_options():
    """A table row's options belong to its script, or to the launcher (how the server was started)."""
    launcher = {flag for action in _parser()._actions for flag in action.option_strings}
    rows = re.findall(rf"^\| `(\w+\.py)` \|(.*)$", _readme(), flags=re.M)
    assert rows, "the README's table changed"
    wrong = [(s, f) for s, row in rows for f in re.findall(rf"(?<![\w-])({FLAG})", row)
             if f not in _options(s) | launcher]
    assert wrong == []
