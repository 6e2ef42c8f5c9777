"""The layer contract in pyproject.toml ([tool.importlinter]) holds for the tree, and breaks when a
lower layer imports an upper one.

import-linter finds a package's modules by walking its folder, and `splitfuse.kernels` lives
in kernels/, outside backend/ (pyproject's package-dir), so the check runs over a copy that
lays the package out as it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (pip extra dev)")


def _installed_layout(dest: Path) -> Path:
    """backend/ as splitfuse/, kernels/ as splitfuse/kernels/ (Python files only)."""
    python_only = shutil.ignore_patterns("__pycache__", "csrc", "*.so", "*.cpp", "*.h")
    shutil.copytree(ROOT / "backend", dest / "splitfuse", ignore=python_only)
    shutil.copytree(ROOT / "kernels", dest / "splitfuse" / "kernels", ignore=python_only)
    return dest


def _lint(src: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src))  # the copy shadows the editable install
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=src, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_its_layers(tmp_path):
    result = _lint(_installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("lower, upper", [
    ("layers/linear.py", "splitfuse.engine.llm_engine"),  # a layer reaching into the engine
    ("engine/block_manager.py", "splitfuse.engine.loop"),  # inside the engine: allocator above its driver
    ("kernels/cpu/build.py", "splitfuse.launcher.cli"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, lower, upper):
    src = _installed_layout(tmp_path)
    module = src / "splitfuse" / lower
    # Inside a function, as a local import dodging a cycle would be: it must be caught too.
    module.write_text(module.read_text() + f"\n\ndef _upward():\n    import {upper}  # noqa: F401\n")
    result = _lint(src)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and upper in result.stdout, result.stdout
