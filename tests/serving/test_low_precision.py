"""Serving in low precision: a real tritonserver started with `--param quantization=int8`, one
with `--param dtype=bfloat16` and one with both answers greedy requests with the tokens the offline engine gives
under the same settings, and logs the weight memory by dtype."""

from __future__ import annotations

import random

import pytest
from conftest import offline_engine_greedy, one_instance_server, served_greedy

import torch

from splitfuse.layers.int8_linear import int8_supported

pytestmark = pytest.mark.serving

SETTINGS = {
    "int8": {"quantization": "int8"},
    "bfloat16": {"dtype": "bfloat16", "attention_backend": "auto"},
    "int8-bfloat16": {"quantization": "int8", "dtype": "bfloat16"},
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def low_precision_server(request, tiny_llama, tmp_path_factory):
    if request.param.startswith("int8"):
        ok, why = int8_supported(torch.device("cpu"))
        if not ok:
            pytest.skip(f"int8 linear unavailable: {why}")
    with one_instance_server(tiny_llama, SETTINGS[request.param],
                             tmp_path_factory.mktemp(f"triton-{request.param}")) as (params, server):
        yield request.param, params, server


def test_served_low_precision_matches_offline_engine(low_precision_server, tiny_llama):
    name, params, server = low_precision_server
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 400) for _ in range(n)] for n in (5, 40, 90)]
    want, decoder_layers = offline_engine_greedy(tiny_llama, params, prompts, max_tokens=12)
    for prompt, expected in zip(prompts, want):
        r = served_greedy(server.grpc_url, prompt, max_tokens=12)
        assert r.error is None, r.error
        assert r.output_ids == expected, f"{name}: served tokens differ from the offline engine's"
    log = open(server.log_file, errors="replace").read()
    ready = [line for line in log.splitlines() if "splitfuse engine ready" in line]
    assert ready and "weights=" in ready[0]
    assert ("int8" in ready[0].split("weights=")[1]) == name.startswith("int8")
    # The ready line says how the decoder layers run, as the offline engine under the same
    # settings on this CPU does (in one C++ call where its kernels are chosen here).
    assert f"decoder layers in {decoder_layers};" in ready[0], (decoder_layers, ready[0])
