"""The Makefile's set-up, read through `make -n` (what it would run): serving needs only,
the test tools apart, a CPU torch where no NVIDIA GPU is found, `make clean` keeping models/."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _dry_run(target: str, tmp_path: Path, *args: str, path: str | None = None) -> str:
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    env.pop("TORCH_INDEX_URL", None)
    env.pop("MAKEFLAGS", None)
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _no_gpu_here() -> bool:
    return shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists()


def test_install_is_serving_only_and_install_dev_adds_the_test_tools(tmp_path):
    serve = _dry_run("install", tmp_path)
    assert "-e '.[triton,serve]'" in serve
    for tool in ("[triton,serve,dev]", "hadolint", "kubernetes-validate", "kubectl"):
        assert tool not in serve, tool
    dev = _dry_run("install-dev", tmp_path)
    for tool in ("[triton,serve,dev]", "hadolint", "kubernetes-validate", "kubectl"):
        assert tool in dev, tool
    assert "[triton,serve,dev]" in _dry_run("test", tmp_path)


@pytest.mark.skipif(not _no_gpu_here(), reason="this machine has an NVIDIA GPU")
def test_torch_index_follows_the_gpu(tmp_path):
    assert f"--index-url '{CPU_INDEX}'" in _dry_run("install", tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    with_gpu = _dry_run("install", tmp_path, path=f"{bin_dir}:{os.environ['PATH']}")
    assert "--index-url" not in with_gpu  # PyPI's CUDA build
    chosen = _dry_run("install", tmp_path, "TORCH_INDEX_URL=https://example.invalid/cu128")
    assert "--index-url 'https://example.invalid/cu128'" in chosen


def test_clean_keeps_models(tmp_path):
    recipe = _dry_run("clean", tmp_path)
    assert "rm -rf" in recipe
    assert "models" not in recipe.split()
    assert not any(word.startswith("models") for word in recipe.split())
