"""Launch the real Triton Inference Server with the splitfuse model repository.

    python -m splitfuse.server --model DIR [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
        [--param NAME=VALUE ...] [--instances N] [--model-repository-out DIR]

Steps: find `tritonserver` (inside the nvidia-pytriton wheel, or a Triton container's
/opt/tritonserver), build a backend directory holding the Python backend plus the stub for
the running interpreter, render `model_repository/` with the checkpoint and engine
parameters filled in, start the server with the library path the stub needs, wait until it
is ready, and stop it cleanly on SIGINT/SIGTERM (in-flight generations get --drain-timeout
seconds to finish, the rest are aborted with a final response, then Triton unloads).

The pieces are functions so that tests and benchmarks reuse them:

    with serve(model_dir, params={"num_kv_blocks": "256"}) as server:
        server.grpc_url, server.http_url, server.metrics_url
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitfuse import control
from splitfuse.config import EngineConfig

# Template repository: the source tree's `model_repository/` unless overridden (an installed,
# non-editable package does not carry it; the Dockerfile sets the variable).
TEMPLATE_ENV = "SPLITFUSE_MODEL_REPOSITORY"
TRITON_ROOT_ENV = "SPLITFUSE_TRITON_ROOT"
LLM_MODEL = "llm"
PREPROCESSING_MODEL = "preprocessing"
PLACEHOLDER_PREFIX = "${"


def default_template_dir() -> Path:
    env = os.environ.get(TEMPLATE_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "model_repository"


# --------------------------------------------------------------------------- tritonserver


@dataclass(frozen=True)
class TritonInstall:
    root: Path
    """Directory holding bin/tritonserver."""
    python_backend: Path
    """Directory holding libtriton_python.so and triton_python_backend_utils.py."""
    stub: Path | None
    """Stub for the running Python when it is not already beside libtriton_python.so."""

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"


def find_tritonserver(root: str | os.PathLike | None = None) -> TritonInstall:
    """Locate tritonserver: `root`, $SPLITFUSE_TRITON_ROOT, the nvidia-pytriton wheel, /opt/tritonserver."""
    candidates: list[Path] = []
    if root is not None:
        candidates.append(Path(root))
    elif os.environ.get(TRITON_ROOT_ENV):
        candidates.append(Path(os.environ[TRITON_ROOT_ENV]))
    else:
        try:
            import pytriton  # type: ignore[import-not-found]

            candidates.append(Path(pytriton.__file__).resolve().parent / "tritonserver")
        except ImportError:
            pass
        candidates.append(Path("/opt/tritonserver"))
    tried = []
    for cand in candidates:
        tried.append(str(cand))
        if not (cand / "bin" / "tritonserver").is_file():
            continue
        backend = cand / "backends" / "python"
        if not (backend / "libtriton_python.so").is_file():
            raise FileNotFoundError(f"{cand} has tritonserver but no Python backend at {backend}")
        if (backend / "triton_python_backend_stub").is_file():
            # A Triton container: its stub is built for the container's Python.
            return TritonInstall(cand, backend, None)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = cand / "python_backend_stubs" / ver / "triton_python_backend_stub"
        if not stub.is_file():
            raise FileNotFoundError(f"no Python backend stub for Python {ver} under {cand}")
        return TritonInstall(cand, backend, stub)
    raise FileNotFoundError(
        "tritonserver not found (tried: " + ", ".join(tried) + "); `pip install nvidia-pytriton==0.7.0` "
        f"or set {TRITON_ROOT_ENV}"
    )


def build_backend_dir(dest: str | os.PathLike, install: TritonInstall) -> Path:
    """Make DEST/python with links to the Python backend and the stub for this interpreter.

    The wheel keeps one stub per Python version apart from the backend library, and Triton
    looks for the stub beside the library; linking into a directory of our own avoids
    writing into site-packages.
    """
    dest = Path(dest)
    if install.stub is None:
        return install.python_backend.parent
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": install.python_backend / "libtriton_python.so",
        "triton_python_backend_utils.py": install.python_backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": install.stub,
    }
    for name, target in links.items():
        link = py / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and os.readlink(link) == str(target):
                continue
            link.unlink()
        link.symlink_to(target)
    return dest


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so that its stubs run this interpreter's environment.

    LD_LIBRARY_PATH: without the interpreter's own libpython first, the stub may load the
    system one and fail at `import ssl`. PATH/VIRTUAL_ENV: the stub's embedded interpreter
    finds its prefix (and so site-packages) from them.
    """
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    # Several stubs share few cores: tokenizers' own thread pool only adds contention.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# --------------------------------------------------------------------------- repository


def parse_params(items: list[str] | None) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}, checking names against EngineConfig."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--param expects NAME=VALUE, got {item!r}")
        out[name] = value
    EngineConfig.check_names(out)
    return out


def render_model_repository(
    out_dir: str | os.PathLike,
    model: str | os.PathLike,
    params: Mapping[str, str] | None = None,
    instances: int = 1,
    preprocessing_instances: int = 1,
    template_dir: str | os.PathLike | None = None,
) -> Path:
    """Copy the template repository to `out_dir` with the checkpoint and engine parameters set.

    `params` are EngineConfig fields (string values, as in config.pbtxt); they are validated
    here by building the EngineConfig, so a typo fails before the server starts.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    template = Path(template_dir) if template_dir is not None else default_template_dir()
    if not (template / LLM_MODEL / "config.pbtxt").is_file():
        raise FileNotFoundError(f"no model repository template at {template} (set {TEMPLATE_ENV})")
    if instances < 1 or preprocessing_instances < 1:
        raise ValueError("instance counts must be >= 1")
    model_path = Path(model).resolve()
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{model_path} is not a Hugging Face checkpoint directory (no config.json)")
    params = dict(params or {})
    EngineConfig.check_names(params)
    params["model"] = str(model_path)
    if params.get("tokenizer"):
        params["tokenizer"] = str(Path(params["tokenizer"]).resolve())

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(template, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    def edit(name: str, fn) -> None:
        path = out / name / "config.pbtxt"
        cfg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        fn(cfg)
        path.write_text(text_format.MessageToString(cfg))

    def edit_llm(cfg) -> None:
        for key, value in params.items():
            cfg.parameters[key].string_value = str(value)
        values = {k: v.string_value for k, v in cfg.parameters.items()}
        _check_filled(LLM_MODEL, values)
        EngineConfig.from_strings(values)  # raises ValueError naming the bad field
        _set_instances(cfg, instances)

    def edit_pre(cfg) -> None:
        cfg.parameters["tokenizer"].string_value = params.get("tokenizer") or str(model_path)
        _check_filled(PREPROCESSING_MODEL, {k: v.string_value for k, v in cfg.parameters.items()})
        _set_instances(cfg, preprocessing_instances)

    # Empty version directories (the ensemble's) are not kept by git but Triton needs them.
    for model_dir in out.iterdir():
        if (model_dir / "config.pbtxt").is_file() and not any(p.name.isdigit() for p in model_dir.iterdir()):
            (model_dir / "1").mkdir()
    edit(LLM_MODEL, edit_llm)
    if (out / PREPROCESSING_MODEL / "config.pbtxt").is_file():
        edit(PREPROCESSING_MODEL, edit_pre)
    return out


def _check_filled(model: str, values: Mapping[str, str]) -> None:
    left = sorted(k for k, v in values.items() if v.startswith(PLACEHOLDER_PREFIX))
    if left:
        raise ValueError(f"{model}: parameter(s) {left} still hold template placeholders")


def _set_instances(cfg, count: int) -> None:
    if not cfg.instance_group:
        cfg.instance_group.add()
    for group in cfg.instance_group:
        group.count = count


# --------------------------------------------------------------------------- server process


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (another process may still take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is fine
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class TritonServer:
    """One tritonserver process serving a rendered model repository.

    Stopping goes through the llm model first (see `stop`): Triton 2.51's Python backend
    never finishes unloading a decoupled model that had a request in flight when shutdown
    began, and the server then hangs past its exit timeout. So the launcher has the llm
    instances refuse new requests, lets in-flight generations finish (up to
    `drain_timeout_s`), aborts the rest (each stream still gets its final response), and only
    then sends SIGTERM. The instances and the launcher talk through files in `control_dir`
    ($SPLITFUSE_CONTROL_DIR in the stubs' environment).
    """

    model_repository: Path
    backend_dir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str = "0.0.0.0"
    install: TritonInstall | None = None
    log_file: Path | None = None
    """Server output goes here; None inherits the caller's stdout/stderr."""
    control_dir: Path | None = None
    """Shutdown handshake with the llm instances; None: plain SIGTERM."""
    llm_instances: int = 1
    drain_timeout_s: float = 30.0
    exit_timeout_s: int = 10
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    killed: bool = False
    """stop() had to SIGKILL the server."""
    drained: bool = False
    """stop() saw every generation finish (or abort) before it sent SIGTERM."""

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        install = self.install or find_tritonserver()
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *self.extra_args,
        ]

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("server already started")
        # A port taken by another server would make our readiness check talk to that one.
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if not port_is_free(port, self.host):
                raise OSError(f"port {port} is already in use on {self.host or '0.0.0.0'}")
        env = server_env()
        if self.control_dir is not None:
            shutil.rmtree(self.control_dir, ignore_errors=True)
            self.control_dir.mkdir(parents=True)
            env[control.ENV] = str(self.control_dir)
        out = None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_file, "ab")
        try:
            # Own process group: a terminal's Ctrl-C reaches only the launcher, which then
            # runs the shutdown below once; stubs share the group, so killpg reaches them.
            self.process = subprocess.Popen(
                self.command(), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f}s{self._log_tail()}")

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ---- shutdown handshake with the llm instances (files under control_dir) ----------------
    def _wait_idle(self, timeout_s: float) -> bool:
        """Until every llm instance reports no request in flight (or the server is gone)."""
        assert self.control_dir is not None
        deadline = time.monotonic() + timeout_s
        while self.running():
            if control.num_idle(self.control_dir) >= self.llm_instances:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def drain(self, timeout_s: float) -> bool:
        """llm refuses new requests; wait for in-flight ones to finish. True if they all did."""
        if self.control_dir is None or not self.running():
            return True
        control.request_drain(self.control_dir)
        return self._wait_idle(timeout_s)

    def abort_in_flight(self, timeout_s: float = 10.0) -> bool:
        """Abort every generation still running (clients get finish_reason "abort")."""
        if self.control_dir is None or not self.running():
            return True
        control.request_abort(self.control_dir)
        return self._wait_idle(timeout_s)

    def stop(self, drain_timeout_s: float | None = None) -> int | None:
        """Drain, abort what is left, SIGTERM; SIGKILL the process group if Triton hangs."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        self.drain(self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
        finished = self.drained = self.abort_in_flight()
        time.sleep(0.2)  # let the last final responses leave the stubs
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=self.exit_timeout_s + 5.0)
        except subprocess.TimeoutExpired:
            # Triton 2.51 cannot unload a model while a client keeps a gRPC stream open to
            # it (even an idle one), and after its exit timeout it hangs instead of exiting.
            self.killed = True
            print(f"splitfuse.server: tritonserver still running {self.exit_timeout_s + 5:.0f}s after SIGTERM "
                  f"(a client probably keeps a gRPC stream open); killing it"
                  + (" - every generation had already finished" if finished else ""), file=sys.stderr)
            self.kill()
            return proc.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return "\n--- tritonserver log tail ---\n" + self.log_file.read_text(errors="replace")[-n:]

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def serve(
    model: str | os.PathLike,
    params: Mapping[str, str] | None = None,
    *,
    instances: int = 1,
    preprocessing_instances: int = 1,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    host: str = "127.0.0.1",
    workdir: str | os.PathLike | None = None,
    template_dir: str | os.PathLike | None = None,
    log_file: str | os.PathLike | None = "auto",
    ready_timeout_s: float = 600.0,
    drain_timeout_s: float = 0.0,
    exit_timeout_s: int = 10,
    log_verbose: int = 0,
    extra_args: list[str] | None = None,
) -> Iterator[TritonServer]:
    """Render the repository, start tritonserver on the given (or free) ports, yield it ready.

    `workdir` holds the rendered repository, the backend directory, the control directory and
    server.log (a temporary directory, removed afterwards, when not given). On exit the server
    is stopped (in-flight generations get `drain_timeout_s` to finish, then are aborted).
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="splitfuse-serve-"))
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        install = find_tritonserver()
        repo = render_model_repository(
            work / "model_repository", model, params, instances=instances,
            preprocessing_instances=preprocessing_instances, template_dir=template_dir,
        )
        backend_dir = build_backend_dir(work / "backends", install)
        server = TritonServer(
            model_repository=repo, backend_dir=backend_dir,
            http_port=http_port or free_port(), grpc_port=grpc_port or free_port(),
            metrics_port=metrics_port or free_port(), host=host, install=install,
            log_file=(work / "server.log") if log_file == "auto" else (Path(log_file) if log_file else None),
            control_dir=work / "control", llm_instances=instances, drain_timeout_s=drain_timeout_s,
            exit_timeout_s=exit_timeout_s, log_verbose=log_verbose, extra_args=list(extra_args or []),
        )
        server.start()
        stack.callback(server.stop)
        server.wait_ready(ready_timeout_s)
        yield server


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m splitfuse.server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="0.0.0.0", help="address the three endpoints bind to")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="engine parameter (any EngineConfig field), repeatable")
    p.add_argument("--instances", type=int, default=1, help="llm instance_group count (engine replicas)")
    p.add_argument("--preprocessing-instances", type=int, default=1)
    p.add_argument("--model-repository-out", default=None,
                   help="where to render the model repository (default: a temporary directory)")
    p.add_argument("--model-repository-template", default=None,
                   help=f"template repository (default: ${TEMPLATE_ENV} or the source tree's model_repository/)")
    p.add_argument("--triton-root", default=None, help="directory with bin/tritonserver (default: the pytriton wheel)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM, seconds in-flight generations get to finish before they are aborted")
    p.add_argument("--exit-timeout", type=int, default=10,
                   help="tritonserver --exit-timeout-secs: time to unload the models after the drain")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--render-only", action="store_true", help="render the repository and exit")
    p.add_argument("triton_args", nargs="*", help="extra tritonserver arguments, after `--`")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = parse_params(args.param)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.render_only and not args.model_repository_out:
        print("error: --render-only needs --model-repository-out", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="splitfuse-serve-"))
    repo_dir = Path(args.model_repository_out) if args.model_repository_out else work / "model_repository"
    try:
        install = find_tritonserver(args.triton_root)
        repo = render_model_repository(
            repo_dir, args.model, params, instances=args.instances,
            preprocessing_instances=args.preprocessing_instances, template_dir=args.model_repository_template,
        )
        if args.render_only:
            print(f"rendered model repository: {repo}")
            return 0
        backend_dir = build_backend_dir(work / "backends", install)
        server = TritonServer(
            model_repository=repo, backend_dir=backend_dir, http_port=args.http_port, grpc_port=args.grpc_port,
            metrics_port=args.metrics_port, host=args.host, install=install, log_file=None,
            control_dir=work / "control", llm_instances=args.instances, drain_timeout_s=args.drain_timeout,
            exit_timeout_s=args.exit_timeout, log_verbose=args.log_verbose, extra_args=args.triton_args,
        )
        return _run_foreground(server, args.ready_timeout)
    except (ValueError, OSError) as e:  # bad parameters, missing files, ports in use
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_foreground(server: TritonServer, ready_timeout_s: float) -> int:
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)
        if len(signals) == 1:
            print(f"\nsplitfuse.server: {signal.Signals(signum).name}: stopping (in-flight generations get "
                  f"{server.drain_timeout_s:.0f}s to finish, then are aborted; signal again to kill now)",
                  file=sys.stderr, flush=True)
        else:  # a second Ctrl-C: no drain
            server.kill()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not signals and not server.is_ready():
            if not server.running():
                print(f"splitfuse.server: tritonserver exited with code {server.process.returncode}",
                      file=sys.stderr)
                return server.process.returncode or 1
            if time.monotonic() > deadline:
                print(f"splitfuse.server: not ready after {ready_timeout_s:.0f}s, stopping", file=sys.stderr)
                signals.append(signal.SIGTERM)
                break
            time.sleep(0.25)
        if not signals:
            print(
                f"splitfuse.server: ready (listening on {server.host})\n"
                f"  HTTP    http://{server.http_url}  (POST /v2/models/ensemble/generate_stream)\n"
                f"  gRPC    {server.grpc_url}\n"
                f"  metrics {server.metrics_url}\n"
                f"  models  {server.model_repository}",
                flush=True,
            )
        while not signals and server.running():
            time.sleep(0.2)
    finally:
        # Also on an unexpected error here: never leave a tritonserver behind.
        if server.running():
            server.stop()
    code = server.process.returncode
    print(f"splitfuse.server: tritonserver exited with code {code}", file=sys.stderr)
    if signals and code not in (0, -signal.SIGTERM) and server.drained:
        # Every generation had ended; Triton only failed to unload a model in time (2.51: a
        # client still holding a gRPC stream, or an ensemble stream dropped before its final flag).
        print("splitfuse.server: every generation had finished before shutdown; tritonserver could not "
              "unload a model in time (see README: known limitations)", file=sys.stderr)
        return 0
    if signals:
        return 0 if code in (0, -signal.SIGTERM) else 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
