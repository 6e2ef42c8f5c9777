"""docs/troubleshooting.md quotes log lines exactly: every line of its `log` blocks is found in
the string literals of backend/ (f-strings and %-formats with their values as placeholders,
names of string constants resolved), and every line of its `triton-log` blocks in the strings of
the Python backend Triton runs, so a reworded message cannot leave the page behind."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"
HOLE = "\0"  # where a value goes
PLACEHOLDER = re.compile(r"<[^<>]*>")
PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdfgr]")
MIN_PART = 4  # each side of a fragment that spans two literals


def _blocks(kind: str) -> list[str]:
    text = DOC.read_text()
    return [line.strip() for block in re.findall(rf"```{kind}\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip()]


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level NAME = "text" assignments of every module (SERVER_BUSY, RANDOM_WARNING...)."""
    out = {}
    for tree in trees:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                out[node.targets[0].id] = node.value.value
    return out


def _text(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return PERCENT.sub(HOLE, node.value)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(value.value)
            elif isinstance(value.value, ast.Name) and value.value.id in constants and value.format_spec is None:
                parts.append(constants[value.value.id])
            else:
                parts.append(HOLE)
        return "".join(parts)
    return None


@cache
def _pieces() -> tuple[str, ...]:
    """Every literal of backend/, cut at its holes."""
    trees = [ast.parse(p.read_text()) for p in sorted((ROOT / "backend").rglob("*.py"))]
    constants = _constants(trees)
    pieces = []
    for tree in trees:
        for node in ast.walk(tree):
            text = _text(node, constants)
            if text:
                pieces.extend(p for p in text.split(HOLE) if p)
    return tuple(pieces)


def _found(fragment: str, pieces: tuple[str, ...]) -> bool:
    """In one piece, or the end of one piece followed by the start of another (a message
    interpolated into a line: `f"error: {e}"`)."""
    if any(fragment in p for p in pieces):
        return True
    return any(any(p.endswith(fragment[:i]) for p in pieces) and any(p.startswith(fragment[i:]) for p in pieces)
               for i in range(MIN_PART, len(fragment) - MIN_PART + 1))


def _missing(lines: list[str], pieces: tuple[str, ...]) -> list[str]:
    return [f"{line!r}: {fragment!r}" for line in lines for fragment in PLACEHOLDER.split(line)
            if fragment.strip() and not _found(fragment, pieces)]


def test_every_quoted_log_line_is_in_the_code():
    lines = _blocks("log")
    assert len(lines) >= 15, lines
    assert _missing(lines, _pieces()) == []


def test_a_reworded_line_is_caught():
    assert _missing(["splitfuse.launcher: tritonserver quit with code <N>"], _pieces())
    assert _missing(["server busy: <N> requests wait (max_waiting_requests=<N>)"], _pieces())


def test_tritons_own_lines_are_in_its_python_backend():
    pytriton = pytest.importorskip("pytriton")
    library = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python" / "libtriton_python.so"
    if not library.is_file():
        pytest.skip(f"no {library}")
    strings = tuple(m.decode() for m in re.findall(rb"[\x20-\x7e]{4,}", library.read_bytes()))
    lines = _blocks("triton-log")
    assert lines and _missing(lines, strings) == []
