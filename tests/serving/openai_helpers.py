"""The OpenAI-compatible front (`python -m splitfuse.openai_api`) started as a process beside a
test's tritonserver, and the `openai` SDK client for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitfuse.launcher.process import free_port


@dataclass
class Api:
    base_url: str
    model: str
    process: subprocess.Popen
    log_file: Path

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)


def start_api(model_dir: str, grpc_url: str, tmp_path: Path, name: str, *extra: str,
              env: dict[str, str] | None = None) -> Api:
    """The front for the tritonserver at `grpc_url` serving `model_dir`, ready; its log in tmp_path.
    `env`: variables added to this process's environment for it."""
    port = free_port()
    log_file = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "splitfuse.openai_api", "--model", model_dir,
           "--triton-grpc-url", grpc_url, "--port", str(port), "--log-level", "warning", *extra]
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the OpenAI API did not start: {log_file.read_text()[-2000:]}")
        time.sleep(0.3)
    return Api(base, Path(model_dir).resolve().name, proc, log_file)


def stop_api(api: Api) -> None:
    api.process.terminate()
    try:
        api.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        api.process.kill()
        api.process.wait()


# The schemas the structured-output tests of chat and of Responses share.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
