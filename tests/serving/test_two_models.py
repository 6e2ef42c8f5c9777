"""Several models in one Triton: two LLMs rendered with different name prefixes into one model
repository, beside another team's model named `preprocessing`, all served by one tritonserver.
Each LLM's ensemble and llm answer with its own checkpoint's greedy tokens (the offline engine's),
the other team's model answers as it did, and each llm model's OpenAI front reaches its own."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import ENGINE_PARAMS, offline_greedy
from openai_helpers import start_api, stop_api
from triton_helpers import grpc_generate

from splitfuse.launcher import build_backend_dir, find_tritonserver, free_port, render_model_repository
from splitfuse.launcher.process import TritonServer

pytestmark = pytest.mark.serving

PARAMS = {**ENGINE_PARAMS, "num_kv_blocks": "128"}
PROMPT = [1, 17, 33, 49, 65, 81]


def _foreign_model(repo: Path) -> None:
    """Another team's model that happens to be called `preprocessing`: it doubles its input."""
    (repo / "preprocessing" / "1").mkdir(parents=True)
    (repo / "preprocessing" / "config.pbtxt").write_text(textwrap.dedent('''
        name: "preprocessing"
        backend: "python"
        max_batch_size: 0
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
    '''))
    (repo / "preprocessing" / "1" / "model.py").write_text(textwrap.dedent('''
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
                return out
    '''))


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    try:
        install = find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("two-models")
    repo = work / "repo"
    _foreign_model(repo)
    models = {"a-": tiny_model_factory("llama"), "b-": tiny_model_factory("qwen2")}
    for prefix, model in models.items():
        render_model_repository(repo, model, PARAMS, name_prefix=prefix)
    assert (repo / "preprocessing" / "1" / "model.py").read_text().count("x * 2") == 1  # left alone
    srv = TritonServer(model_repository=repo, backend_dir=build_backend_dir(work / "backends", install),
                       http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), install=install,
                       log_file=work / "server.log", control_dir=work / "control", llm_instances=2)
    srv.start()
    try:
        srv.wait_ready(600)
        yield srv, models
    finally:
        srv.stop()


def test_two_llms_and_a_foreign_model_share_one_server(server):
    srv, models = server
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    names = {m["name"] for m in client.get_model_repository_index(
        headers={"triton-grpc-protocol-splitfuse-admin-key": srv.admin_key}, as_json=True)["models"]}
    assert {"a-ensemble", "a-llm", "a-preprocessing", "b-ensemble", "b-llm", "b-preprocessing",
            "preprocessing"} <= names
    for prefix, model in models.items():
        expected = offline_greedy(model, PARAMS, [PROMPT], 6)[0]
        direct = grpc_generate(srv.grpc_url, f"{prefix}llm", {"input_ids": PROMPT, "max_tokens": 6,
                                                              "temperature": 0.0, "ignore_eos": True})
        assert direct.error is None and direct.output_ids == expected, prefix
        # Through its own ensemble (its own tokenizer, its own llm): the same engine's greedy text.
        via = grpc_generate(srv.grpc_url, f"{prefix}ensemble", {"text_input": "hello there", "max_tokens": 4,
                                                                "temperature": 0.0, "ignore_eos": True})
        alone = grpc_generate(srv.grpc_url, f"{prefix}llm", {"text_input": "hello there", "max_tokens": 4,
                                                             "temperature": 0.0, "ignore_eos": True})
        assert via.error is None and via.output_ids == alone.output_ids and len(via.output_ids) == 4
    # The two checkpoints differ, so a mix-up would show.
    assert offline_greedy(models["a-"], PARAMS, [PROMPT], 6) != offline_greedy(models["b-"], PARAMS, [PROMPT], 6)
    x = grpcclient.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1.5, -2.0], np.float32))
    y = client.infer("preprocessing", [x]).as_numpy("Y")
    assert y.tolist() == [3.0, -4.0]


def test_an_openai_front_for_each_llm(server, tmp_path):
    srv, models = server
    for prefix, model in models.items():
        api = start_api(model, srv.grpc_url, tmp_path, f"{prefix}api", "--triton-model", f"{prefix}llm")
        try:
            text = api.client().completions.create(model=api.model, prompt="hello there", max_tokens=4,
                                                   temperature=0).choices[0].text
        finally:
            stop_api(api)
        alone = grpc_generate(srv.grpc_url, f"{prefix}llm", {"text_input": "hello there", "max_tokens": 4,
                                                             "temperature": 0.0})
        assert text == alone.text.decode(), prefix


def test_render_refuses_a_bad_prefix(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="prefix"):
        render_model_repository(tmp_path / "r", tiny_llama, name_prefix="a/b")
    shutil.rmtree(tmp_path / "r", ignore_errors=True)
