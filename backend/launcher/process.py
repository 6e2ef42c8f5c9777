"""Running one tritonserver process: free ports, start, readiness, and the drain before
SIGTERM that Triton 2.51 needs to unload a decoupled model cleanly."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitfuse.triton import control
from splitfuse.launcher.repository import render_model_repository
from splitfuse.launcher.triton_install import TritonInstall, build_backend_dir, find_tritonserver, server_env

# Header that unlocks the model-repository API (load/unload); its value is random per server.
REPOSITORY_API_HEADER = "splitfuse-repository-key"


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
    host: str = "127.0.0.1"
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
    _repository_api_key: str = field(default="", repr=False)

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
            *self._model_control_args(),
            *self.extra_args,
        ]

    def _model_control_args(self) -> list[str]:
        """Explicit model control, every model loaded at start: the one way a Python model can
        stop reporting ready in Triton 2.51 is to unload itself (`pb_utils.unload_model`), which
        the llm model does when its engine broke. Clients keep the repository API they had
        (none): it is restricted to a header only this process knows."""
        if any(a.startswith("--model-control-mode") for a in self.extra_args):
            return []
        if not self._repository_api_key:
            self._repository_api_key = secrets.token_hex(16)
        restricted = f"model-repository:{REPOSITORY_API_HEADER}={self._repository_api_key}"
        return ["--model-control-mode=explicit", "--load-model=*", f"--http-restricted-api={restricted}",
                f"--grpc-restricted-protocol={restricted}"]

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
        print(f"splitfuse.launcher: draining: new requests are refused, in-flight generations get {timeout_s:g}s",
              file=sys.stderr, flush=True)
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
            print(f"splitfuse.launcher: tritonserver still running {self.exit_timeout_s + 5:.0f}s after SIGTERM "
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
