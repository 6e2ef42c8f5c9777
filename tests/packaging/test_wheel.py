"""The wheel, installed non-editable: every module imports and the launcher serves from it.

The wheel is built from a copy of the sources (so the tree gets no build/ or egg-info) and
installed with --no-deps into a fresh virtual environment that sees the main environment's
third-party packages through a .pth file processed after its own site-packages: the installed
splitfuse shadows the editable one, and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from triton_helpers import grpc_generate  # noqa: E402

from splitfuse.launcher import find_tritonserver, free_port, port_is_free  # noqa: E402

pytestmark = [pytest.mark.serving, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# What the build needs: pyproject.toml names README.md as the long description, LICENSE as its licence file.
SOURCES = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "backend", "kernels", "model_repository"]

# Modules that may fail to import in the installed package, and only with an ImportError
# naming a module of an optional dependency (none is expected where `make install` ran).
OPTIONAL = {
    "triton": "the [triton] extra (Triton-lang kernels, splitfuse.kernels.triton_lang)",
    "triton_python_backend_utils": "only inside a Triton Python-backend stub",
}

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys, traceback
import splitfuse
from splitfuse.launcher import default_template_dir
out = {"file": splitfuse.__file__, "template": str(default_template_dir()), "ok": [], "commands": [], "failed": {}}
def record(name, exc):
    out["failed"][name] = {"type": type(exc).__name__, "missing": getattr(exc, "name", None),
                           "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()}
def onerror(name):
    record(name, sys.exc_info()[1])
for mod in pkgutil.walk_packages(splitfuse.__path__, "splitfuse.", onerror=onerror):
    if mod.name.endswith(".__main__"):  # a command (python -m): the serving test runs one
        out["commands"].append(mod.name)
        continue
    try:
        importlib.import_module(mod.name)
        out["ok"].append(mod.name)
    except Exception as exc:
        if mod.name not in out["failed"]:
            record(mod.name, exc)
print(json.dumps(out))
"""


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(python of the fresh venv, its site-packages, the wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, cwd=tmp, timeout=300)
    (wheel,) = dist.glob("splitfuse_triton-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = _site_packages(python)
    # A plain path line: appended to sys.path after the venv's own site-packages, and the main
    # environment's own .pth files (the editable install's finder among them) are not run.
    (site / "zz_main_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, cwd=tmp, timeout=300)
    return python, site, wheel


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "SPLITFUSE_MODEL_REPOSITORY", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def test_wheel_carries_the_runtime_files(wheel_env):
    import zipfile

    _, _, wheel = wheel_env
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "splitfuse/launcher/csrc/argv_secrets.cpp",
        "splitfuse/model_repository/llm/config.pbtxt",
        "splitfuse/model_repository/llm/1/model.py",
        "splitfuse/model_repository/preprocessing/config.pbtxt",
        "splitfuse/model_repository/preprocessing/1/model.py",
        "splitfuse/model_repository/ensemble/config.pbtxt",
        "splitfuse/model_repository/ensemble/1/.gitkeep",
    }
    expected |= {f"splitfuse/kernels/cpu/csrc/{p.name}" for p in (REPO / "kernels/cpu/csrc").iterdir()
                 if p.suffix in (".cpp", ".h")}
    # Every package of the source tree (discovered, not listed by hand).
    for root, prefix in ((REPO / "backend", "splitfuse"), (REPO / "kernels", "splitfuse/kernels")):
        expected |= {f"{prefix}/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py")
                     if "__pycache__" not in p.parts}
    assert expected - names == set()


def test_wheel_declares_its_licence(wheel_env):
    import zipfile

    _, _, wheel = wheel_env
    with zipfile.ZipFile(wheel) as zf:
        info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{info}/METADATA").decode()
        licence = zf.read(f"{info}/licenses/LICENSE").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert licence == (REPO / "LICENSE").read_text()


def test_every_module_imports_from_the_wheel(wheel_env, tmp_path):
    python, site, _ = wheel_env
    run = subprocess.run([str(python), "-c", IMPORT_ALL], capture_output=True, text=True, cwd=tmp_path,
                         env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # The wheel's copy, not the editable source tree, and its own template repository.
    assert Path(out["file"]).resolve() == (site / "splitfuse" / "__init__.py").resolve()
    assert Path(out["template"]).resolve() == (site / "splitfuse" / "model_repository").resolve()
    bad = {name: f for name, f in out["failed"].items()
           if not (f["type"] in ("ImportError", "ModuleNotFoundError")
                   and (f["missing"] or "").split(".")[0] in OPTIONAL)}
    assert bad == {}, json.dumps(bad, indent=1)
    skipped = sorted(out["failed"])
    if skipped:
        print("optional-dependency modules not imported:", skipped)
    expected = {"splitfuse.launcher", "splitfuse.engine.loop", "splitfuse.kernels.cpu.build",
                "splitfuse.openai_api", "splitfuse.models"}
    assert expected <= set(out["ok"])
    assert {"splitfuse.launcher.__main__", "splitfuse.openai_api.__main__"} <= set(out["commands"])
    print(f"imported {len(out['ok'])} modules from the wheel")
    assert len(out["ok"]) + len(skipped) >= 60


def test_installed_launcher_serves_and_stops_on_sigint(wheel_env, tiny_model_factory, tmp_path):
    """`python -m splitfuse.launcher` of the fresh venv renders the packaged template and serves
    a generation over gRPC; SIGINT stops it with exit code 0."""
    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    python, site, _ = wheel_env
    model = tiny_model_factory("llama")
    ports = [free_port() for _ in range(4)]
    repo_out = tmp_path / "repo"
    cmd = [str(python), "-m", "splitfuse.launcher", "--model", model,
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]),
           "--param", "device=cpu", "--param", "num_kv_blocks=64", "--param", "num_threads=1",
           "--drain-timeout", "0.5", "--model-repository-out", str(repo_out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=_env())
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("splitfuse.launcher: ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(300), "".join(lines[-40:])
        # The rendered repository is the wheel's template.
        packaged = site / "splitfuse" / "model_repository"
        assert (repo_out / "llm" / "1" / "model.py").read_bytes() == (packaged / "llm" / "1" / "model.py").read_bytes()
        result = grpc_generate(f"127.0.0.1:{ports[1]}", "llm",
                               {"text_input": "hello", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        assert result.error is None, result.error
        assert len(result.output_ids) == 8 and result.finish_reason == "length"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines[-40:])
    finally:
        if proc.poll() is None:  # never leave a tritonserver behind: a second signal kills it
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
    reader.join(timeout=5)
    out = "".join(lines)
    assert "tritonserver exited with code 0" in out, out[-4000:]
    assert all(port_is_free(p, "127.0.0.1") for p in ports)
