"""Running one tritonserver process: free ports, start, readiness, and the drain before
SIGTERM that Triton 2.51 needs to unload a decoupled model cleanly."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitfuse.launcher import hidden_args
from splitfuse.utils.ports import free_port, port_is_free
from splitfuse.utils.children import die_with_parent
from splitfuse.openai_api.config import API_KEY_ENV
from splitfuse.triton_server import control
from splitfuse.launcher.repository import render_model_repository
from splitfuse.launcher.triton_install import TritonInstall, build_backend_dir, find_tritonserver, server_env

# Triton's API groups a client may use only with the admin header: registering shared memory
# (the Python backend's shared-memory chain was remotely exploitable before 25.07), loading and
# unloading models, reading model configs, statistics, and changing trace and log settings.
# Inference, health, metadata and metrics stay open.
ADMIN_APIS = ("shared-memory", "model-repository", "model-config", "statistics", "trace", "logging")
ADMIN_HEADER = "splitfuse-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER  # Triton's name for it in gRPC metadata
ADMIN_KEY_ENV = "SPLITFUSE_TRITON_ADMIN_KEY"  # where the launcher and perf/ take the operator's key from
ADMIN_KEY_SECRET = "ADMIN_KEY"  # its name for hidden_args (the key never goes on the command line)


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
    """Where the metrics endpoint binds (and the inference endpoints, unless `inference_host`)."""
    inference_host: str | None = None
    """Where Triton's HTTP and gRPC endpoints bind; None: `host`. Separate because they have no
    authentication (the launcher keeps them on loopback while metrics may be public)."""
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
    admin_key: str | None = field(default=None, repr=False)
    """Value of the `splitfuse-admin-key` header that opens Triton's ADMIN_APIS; None: a random
    key given to no one (the APIs are closed)."""
    restrict_admin_apis: bool = True
    """False leaves ADMIN_APIS open to every client that reaches the ports (Triton's default)."""
    _shim: Path | None = field(default=None, repr=False)

    @property
    def bind_inference(self) -> str:
        return self.host if self.inference_host is None else self.inference_host

    def _bindings(self) -> list[tuple[int, str]]:
        """(port, address) of each listener."""
        return [(self.http_port, self.bind_inference), (self.grpc_port, self.bind_inference),
                (self.metrics_port, self.host)]

    @staticmethod
    def _client_host(bound: str) -> str:
        return "127.0.0.1" if bound in ("0.0.0.0", "") else bound

    @property
    def http_url(self) -> str:
        return f"{self._client_host(self.bind_inference)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host(self.bind_inference)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host(self.host)}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        install = self.install or find_tritonserver()
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={self.bind_inference}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.bind_inference}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *self._model_control_args(),
            *self._restriction_args(),
            *self.extra_args,
        ]

    def _model_control_args(self) -> list[str]:
        """Explicit model control, every model loaded at start: the one way a Python model can
        stop reporting ready in Triton 2.51 is to unload itself (`pb_utils.unload_model`), which
        the llm model does when its engine broke. Clients get the repository API only with the
        admin header (`_restriction_args`)."""
        if any(a.startswith("--model-control-mode") for a in self.extra_args):
            return []
        return ["--model-control-mode=explicit", "--load-model=*"]

    def _restriction_args(self) -> list[str]:
        """ADMIN_APIS behind the admin header, over HTTP and gRPC. The key is a placeholder that
        the preloaded shim fills in (hidden_args), so `ps` never shows it."""
        if not self.restrict_admin_apis or any(
                a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for a in self.extra_args):
            return []
        if self.admin_key is None:
            self.admin_key = secrets.token_hex(16)
        value = hidden_args.placeholder(ADMIN_KEY_SECRET) if self._shim is not None else self.admin_key
        restricted = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={value}"
        return [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]

    def _prepare_secrets(self, env: dict[str, str]) -> dict[str, str]:
        """The server's environment with what the shim needs to fill in the admin key, and
        without the keys the launcher was given (the stubs need neither)."""
        for name in (ADMIN_KEY_ENV, API_KEY_ENV):
            env.pop(name, None)
        if not self.restrict_admin_apis:
            return env
        self._shim = hidden_args.shim()
        if self._shim is None:
            if self.admin_key is not None:
                raise RuntimeError("an admin key needs a C++ compiler (g++, or $CXX) to keep it off tritonserver's "
                                   "command line, where every local user could read it; install one")
            print("splitfuse.launcher: no C++ compiler: Triton's admin APIs are closed with a random key that "
                  "appears on tritonserver's command line (local users can read it with ps)", file=sys.stderr)
            return env
        if self.admin_key is None:
            self.admin_key = secrets.token_hex(16)
        return hidden_args.environment({ADMIN_KEY_SECRET: self.admin_key}, self._shim, env)

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("server already started")
        # A port taken by another server would make our readiness check talk to that one.
        for port, address in self._bindings():
            if not port_is_free(port, address):
                raise OSError(f"port {port} is already in use on {address or '0.0.0.0'}")
        env = self._prepare_secrets(server_env())
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
            # runs the shutdown below once; stubs share the group, so killpg reaches them. And
            # killed with the launcher, however it dies (children.py).
            self.process = subprocess.Popen(
                self.command(), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent(),
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
        if control.draining_requested(self.control_dir):  # already draining: just wait
            return self._wait_idle(timeout_s)
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

    def restart(self, ports_timeout_s: float = 30.0) -> None:
        """After a fault: kill what is left of the server (its stubs too: the group outlives a
        dead tritonserver while a stub runs), wait for its ports, start it again. Not ready yet
        when this returns (`wait_ready`)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
        deadline = time.monotonic() + ports_timeout_s
        while not all(port_is_free(p, address) for p, address in self._bindings()):
            if time.monotonic() > deadline:
                raise OSError(f"the ports of the killed server are still taken after {ports_timeout_s:.0f}s")
            time.sleep(0.1)
        self.start()

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
    admin_key: str | None = None,
    restrict_admin_apis: bool = True,
) -> Iterator[TritonServer]:
    """Render the repository, start tritonserver on the given (or free) ports, yield it ready.

    `workdir` holds the rendered repository, the backend directory, the control directory and
    server.log (a temporary directory, removed afterwards, when not given). On exit the server
    is stopped (in-flight generations get `drain_timeout_s` to finish, then are aborted).
    `admin_key`: the `splitfuse-admin-key` header value that opens Triton's ADMIN_APIS (closed
    to everyone when None); `restrict_admin_apis=False` leaves them open.
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
            admin_key=admin_key, restrict_admin_apis=restrict_admin_apis,
        )
        server.start()
        stack.callback(server.stop)
        server.wait_ready(ready_timeout_s)
        yield server
