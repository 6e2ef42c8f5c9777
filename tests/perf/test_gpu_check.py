"""The GPU check's dry run (perf/gpu_check.py, issue 63): every step it takes on a lent GPU
machine, on this CPU, so that it cannot rot before a GPU comes."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _wheel(folder: Path, filename: str, module: str, body: str) -> None:
    dist = filename.split("-")[0] + "-" + filename.split("-")[1]
    with zipfile.ZipFile(folder / filename, "w") as z:
        z.writestr(f"{module}/__init__.py", body)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")


def test_dry_run_carries_wheels_runs_every_part_and_kills_one_past_its_timeout(tmp_path):
    carry = tmp_path / "carry"
    carry.mkdir()
    _wheel(carry, "carried_probe-1.0-py3-none-any.whl", "carried_probe", "VALUE = 42\n")
    _wheel(carry, "other_python_probe-1.0-cp39-cp39-manylinux_2_17_x86_64.whl", "other_python_probe", "")
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "perf/gpu_check.py", "--dry-run", "--carry", str(carry), "--out", str(out),
                           "--work", str(work)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[gpu-check] ")]
    parts = json.loads((out / "results.json").read_text())["parts"]
    assert [line.split(":")[0].split()[-1] for line in lines] == list(parts) == \
        ["env", "cuda-tests", "bench-smollm2", "bench-8b", "timeout-probe"]

    # What the device tool brings back: at most 8 files, flat; the carried packages and models stay in --work.
    assert sorted(p.name for p in out.iterdir()) == ["cuda-tests.xml", "gpu_check.log", "results.json"]
    assert "===== timeout-probe: timed out =====" in (out / "gpu_check.log").read_text()
    carried = {c["name"]: c for c in json.loads((work / "carried.json").read_text())}
    assert carried["carried-probe"]["for_this_python"] and not carried["other-python-probe"]["for_this_python"]
    assert not (work / "site" / "other_python_probe").exists()  # another Python's wheel is left out
    env = parts["env"]
    assert env["status"] == "ok" and Path(env["carried"]["carried_probe"]).is_relative_to(work / "site")
    assert Path(env["splitfuse"]).is_relative_to(work / "site")  # the package view, not an install
    assert env["machine"]["cores"] > 0

    tests = parts["cuda-tests"]
    assert tests["status"] == "ok" and "-m cuda" in tests["command"]
    if not torch.cuda.is_available():  # collected, and every one skips itself without a device
        assert "skipped" in tests["summary"] and "passed" not in tests["summary"]
    for name in ("bench-smollm2", "bench-8b"):
        bench = parts[name]
        assert bench["status"] == "ok" and bench["device"] == "cpu"
        assert bench["offline_gen_tokens_per_s"] > 0 and bench["single_stream_ms_per_token"] > 0
    assert parts["bench-smollm2"]["greedy_agreement_with_transformers"] == 1.0  # fp32 on the CPU: identical
    probe = parts["timeout-probe"]
    assert probe["status"] == "timed out" and probe["seconds"] < 30  # killed at 2 s, not left to sleep 60


def test_the_tree_and_the_carried_wheels_fit_what_a_device_run_takes():
    """A device run sends the tracked files and the carried folder: 64 MiB in all (the device tool's
    limit); the wheels take ~1 MB, so the tree must stay under 62 MiB."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    size = sum((ROOT / n.decode()).stat().st_size for n in names.split(b"\0") if n and (ROOT / n.decode()).is_file())
    assert size < 62 << 20, f"the tracked tree is {size / 2**20:.1f} MiB: a device run would refuse it"
