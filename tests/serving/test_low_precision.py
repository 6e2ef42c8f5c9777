"""Serving in low precision: a real tritonserver started with `--param quantization=int8`, one
with `--param dtype=bfloat16` and one with both answers greedy requests with the tokens the offline engine gives
under the same settings, and logs the weight memory by dtype."""

from __future__ import annotations

import os
import random
import re

import pytest
from conftest import offline_engine_greedy, one_instance_server, served_greedy

import torch

from splitfuse.layers.int8_linear import int8_supported
from splitfuse.utils.numa_topology import format_cpulist, read_nodes

pytestmark = pytest.mark.serving

SETTINGS = {
    "int8": {"quantization": "int8"},
    # Also placed on the first NUMA node, as --instances auto places replicas on a multi-node machine.
    "bfloat16": {"dtype": "bfloat16", "attention_backend": "auto", "numa_nodes": str(read_nodes()[0].node)},
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


def test_start_up_facts_in_the_triton_log(low_precision_server):
    """The engine's start-up facts reach Triton's log through pb_utils.Logger (triton_log.py), one
    line each, led by the instance: the KV pool, the backends with dtype and quantization, weight
    bytes, how the decoder layers run, threads with their CPUs and NUMA node."""
    name, params, server = low_precision_server
    lines = [line for line in open(server.log_file, errors="replace").read().splitlines()
             if "llm_0_0: splitfuse: " in line]

    def one(fragment: str) -> str:
        found = [line for line in lines if fragment in line]
        assert len(found) == 1, (fragment, found or lines)
        return found[0]

    blocks = int(params["num_kv_blocks"])
    kv = one("KV cache: ")
    assert f"KV cache: {blocks} blocks of 16 tokens = {blocks * 16} tokens (" in kv and "GiB)" in kv
    backends = one(" attention_backend=")
    dtype = "bfloat16" if params.get("dtype") == "bfloat16" else "float32"
    assert f"dtype={dtype} " in backends and " linear_backend=" in backends
    assert f"quantization={params.get('quantization', 'none')} " in backends and " weights=" in backends
    one("decoder layers in ")
    cpus = os.sched_getaffinity(0)  # the stub inherits the launcher's, as the launcher does this test's
    placed = params.get("numa_nodes")
    if placed:  # pinned to the node's CPUs, memory bound there (or a warning says why not)
        cpus &= next(n.cpus for n in read_nodes() if n.node == int(placed))
    nodes = [n.node for n in read_nodes() if n.cpus & cpus]
    placement = one(" on CPUs ")
    assert f"threads={params['num_threads']} on CPUs {format_cpulist(cpus)} ({len(cpus)}); " in placement
    assert f"NUMA node {format_cpulist(nodes)} of {len(read_nodes())}; " in placement
    refused = [line for line in lines if "memory not bound to NUMA node" in line]
    bound = placed and not refused
    assert placement.endswith(f"memory bound to node(s) {placed}\"") if bound else "; memory not bound" in placement
    assert all(re.match(r"I\d{4} ", line) for line in (kv, backends, placement))  # at Triton's INFO level
