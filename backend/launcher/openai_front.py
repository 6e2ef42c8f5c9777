"""The OpenAI-compatible front beside Triton (`--openai-port`): a child process running
`python -m splitfuse.openai_api` against the server's gRPC endpoint.

A process of its own, so its event loop never competes with the launcher's signal handling
for the GIL; started once Triton is ready and stopped after Triton's drain (cli._shutdown), so
its streams end with their final events; SIGTERM lets uvicorn finish the answers under way.
If it dies the launcher starts it again (supervisor.FrontWatch) with the same command.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from splitfuse.utils.children import die_with_parent
from splitfuse.launcher.lora import LORA_MODULES, resolve_lora_modules


class OpenAIFront:
    def __init__(self, model: str, grpc_url: str, host: str, port: int, params: Mapping[str, str],
                 triton_model: str = "llm", triton_http_url: str | None = None,
                 served_model_name: str | None = None, max_logprob_entries: int | None = None,
                 allow_runtime_lora: bool = False) -> None:
        self.host, self.port, self.triton_model = host, port, triton_model
        self.triton_http_url = triton_http_url
        self.command = [sys.executable, "-m", "splitfuse.openai_api", "--model", model, "--triton-grpc-url", grpc_url,
                        "--triton-model", triton_model, "--host", host, "--port", str(port), "--log-level", "warning"]
        if triton_http_url:  # forward Triton's HTTP API behind the front's key (--triton-proxy)
            self.command += ["--triton-http-proxy", triton_http_url]
        # The front's own options, when the launcher was given them (else the front's defaults).
        if served_model_name is not None:
            self.command += ["--served-model-name", served_model_name]
        if max_logprob_entries is not None:
            self.command += ["--max-logprob-entries", str(max_logprob_entries)]
        if allow_runtime_lora:  # the engine's lora_load_dir bounds what may be read
            self.command += ["--allow-runtime-lora"]
        # The engine settings the front must agree with (its tokenizer, the default max_tokens).
        if params.get("tokenizer"):
            self.command += ["--tokenizer", params["tokenizer"]]
        # The adapters' names (model=NAME picks one) and folders (their cards' root); the
        # launcher made the folders absolute (launcher/lora.py).
        for name, folder in resolve_lora_modules(params.get(LORA_MODULES, "")).items():
            self.command += ["--lora", f"{name}={folder}"]
        self.max_model_len = params.get("max_model_len")
        self.process: subprocess.Popen | None = None
        self._limit: str | int | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, engine_max_model_len: int | None = None) -> None:
        """`engine_max_model_len`: what the engine runs with (it lowers the checkpoint's to what
        its KV cache holds), used unless max_model_len was set."""
        self._limit = limit = self.max_model_len or engine_max_model_len
        # Own session, as tritonserver's: a terminal's Ctrl-C reaches only the launcher, so the
        # front keeps answering (503 for new requests) while Triton drains, and stops after.
        self.process = subprocess.Popen(self.command + (["--max-model-len", str(limit)] if limit else []),
                                        start_new_session=True, preexec_fn=die_with_parent())

    def restart(self) -> None:
        """Start it again as it was started (after it exited)."""
        if self.running():
            raise RuntimeError("the OpenAI front is still running")
        self.start(self._limit)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def answers(self, timeout_s: float = 0.5) -> bool:
        """Whether it answers GET /health at all (503 too: it serves, Triton may be restarting)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """At once, no graceful end (a second Ctrl-C)."""
        if self.running():
            self.process.kill()
            self.process.wait()

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """True once GET /health answers 200 (Triton's llm model is ready behind it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.running():
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.running():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
