"""One real tritonserver for the serving tests: tiny local model, two llm replicas, free ports."""

from __future__ import annotations

import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# Engine parameters of the test server; the offline LLM in the tests takes the same ones.
ENGINE_PARAMS = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": "256",  # 4096 tokens per replica: small, so "used" blocks are easy to watch
    "token_budget": "256",
    "num_threads": "1",  # two replicas share two cores
}
INSTANCES = 2


@dataclass
class Served:
    model_dir: str
    grpc_url: str
    http_url: str
    metrics_url: str
    engine_params: dict[str, str]
    instances: int
    log_file: str
    startup_s: float
    admin_key: str = ""
    """The value of the header that opens Triton's admin APIs (random, this server's only)."""

    def engine_kwargs(self) -> dict:
        """ENGINE_PARAMS as LLM(...) keyword arguments."""
        return engine_kwargs(self.model_dir, self.engine_params)


def engine_kwargs(model_dir: str, params: dict[str, str]) -> dict:
    """A server's string engine parameters as LLM(...) keyword arguments (its server settings
    have no offline meaning)."""
    from splitfuse.config import split_parameters

    cfg, _ = split_parameters({"model": model_dir, **params})
    return {k: getattr(cfg, k) for k in params if hasattr(cfg, k)}


def offline_greedy(model_dir: str, params: dict[str, str], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The offline engine's greedy tokens (ignore_eos) under a server's engine parameters."""
    return offline_engine_greedy(model_dir, params, prompts, max_tokens)[0]


def offline_engine_greedy(model_dir: str, params: dict[str, str], prompts: list[list[int]],
                          max_tokens: int) -> tuple[list[list[int]], str]:
    """offline_greedy's tokens, and how that engine ran its decoder layers on this machine
    (`ModelRunner.decoder_layers`, which the served model's ready line also reports)."""
    from splitfuse.llm import LLM
    from splitfuse.engine.sequence import SamplingParams

    with LLM(model_dir, **engine_kwargs(model_dir, params)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        decoder_layers = llm.engine.runner.decoder_layers
    return [o.token_ids for o in outs], decoder_layers


def served_greedy(grpc_url: str, prompt: list[int], max_tokens: int):
    """One greedy (ignore_eos) request to `llm` over gRPC; the collected stream."""
    from triton_helpers import grpc_generate

    return grpc_generate(grpc_url, "llm", {"input_ids": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                           "ignore_eos": True}, dtypes={"input_ids": "INT32"})


def _need_tritonserver() -> None:
    from splitfuse.launcher import find_tritonserver

    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(f"no tritonserver: {e}")


@contextmanager
def one_instance_server(model_dir: str, settings: dict[str, str], workdir):
    """A server of its own for a module's settings on top of ENGINE_PARAMS, one `llm` instance;
    yields (the engine parameters, the server)."""
    _need_tritonserver()
    from splitfuse.launcher import serve

    params = {**ENGINE_PARAMS, **settings}
    with serve(model_dir, params, instances=1, workdir=workdir) as server:
        yield params, server
        server.stop()


@contextmanager
def fault_server(model_dir: str, params: dict[str, str], workdir, instances: int = 1, **serve_kwargs):
    """A server whose llm model is fault_model.py (faults and slow steps injected by request id,
    see its docstring); yields the server, still running."""
    _need_tritonserver()
    from splitfuse.launcher import default_template_dir, serve

    template = Path(workdir) / "template"
    shutil.copytree(default_template_dir(), template, ignore=shutil.ignore_patterns("__pycache__"))
    version = template / "llm" / "1"
    shutil.copy(Path(__file__).with_name("fault_model.py"), version / "model.py")
    shutil.copy(Path(__file__).with_name("engine_faults.py"), version / "engine_faults.py")
    with serve(model_dir, params, instances=instances, workdir=Path(workdir) / "run", template_dir=template,
               **serve_kwargs) as server:
        yield server


@pytest.fixture(scope="module")
def slow_replicas(tiny_llama, tmp_path_factory):
    """Two replicas whose generations can be slowed by request id (fault_model.py's fault-slow:
    20 ms a step): the tiny model alone makes thousands of tokens a second, so a stop could
    otherwise arrive after the generation it was meant for had ended, and a burst of requests
    would end before the last of them arrived. One server per test module: their tests count
    the server's finished requests."""
    with fault_server(tiny_llama, ENGINE_PARAMS, tmp_path_factory.mktemp("slow"), instances=INSTANCES) as server:
        yield server
        server.stop()


@pytest.fixture(scope="session")
def served(tiny_llama, tmp_path_factory):
    _need_tritonserver()
    from splitfuse.launcher import serve

    work = tmp_path_factory.mktemp("triton")
    start = time.monotonic()
    with serve(tiny_llama, ENGINE_PARAMS, instances=INSTANCES, workdir=work) as server:
        yield Served(
            model_dir=tiny_llama, grpc_url=server.grpc_url, http_url=server.http_url,
            metrics_url=server.metrics_url, engine_params=dict(ENGINE_PARAMS), instances=INSTANCES,
            log_file=str(server.log_file), startup_s=time.monotonic() - start, admin_key=server.admin_key,
        )
        code = server.stop()
    if code != 0:  # not a test failure: Triton 2.51 unload limitations (see README)
        warnings.warn(f"tritonserver exited with code {code} (killed: {server.killed}); log: {server.log_file}")


# The engine's limit for prompt + generation that the shared OpenAI front passes (the test
# server's KV pool could not hold one sequence of the checkpoint's 4096 positions).
FRONT_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def openai_front(served, tmp_path_factory):
    """One OpenAI front for `served`, shared by the modules that need no front of their own."""
    from openai_helpers import start_api, stop_api

    api = start_api(served.model_dir, served.grpc_url, tmp_path_factory.mktemp("openai-front"), "api",
                    "--max-model-len", str(FRONT_MAX_MODEL_LEN))
    yield api
    stop_api(api)


@pytest.fixture(scope="session")
def offline_llm(served):
    """The offline engine with the server's settings, for output comparisons."""
    from splitfuse.llm import LLM

    return LLM(served.model_dir, **served.engine_kwargs())
