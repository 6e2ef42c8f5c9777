"""The prefix cache's tiers below the KV pool on a real server (docs/kv_tiers.md): two replicas
with KV pools too small to keep the conversations' histories, one disk tier folder shared by both
and a host-RAM tier each. Every turn resends its conversation's history; the greedy tokens equal
the offline engine's without tiers, and the replicas restored histories from the tiers instead of
recomputing them (the metrics say how many blocks, and from which tier)."""

from __future__ import annotations

import random

import pytest
from conftest import ENGINE_PARAMS, _need_tritonserver, engine_kwargs
from triton_helpers import grpc_generate, metric_sum, wait_for

pytestmark = pytest.mark.serving

BLOCK = 16
HISTORY_BLOCKS = 5
CONVERSATIONS = 8
# Each replica's pool holds two conversations' turns: with 8 conversations taken in turn, a turn's
# history has been evicted from its replica's pool by the time it comes back.
POOL_BLOCKS = 12
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _turns() -> list[list[int]]:
    rng = random.Random(7)
    histories = [[1] + [rng.randrange(3, 300) for _ in range(HISTORY_BLOCKS * BLOCK - 1)]
                 for _ in range(CONVERSATIONS)]
    return [h + [rng.randrange(3, 300) for _ in range(2 + turn)] for turn in range(3) for h in histories]


def test_turns_restored_from_the_tiers_keep_the_greedy_tokens(tiny_llama, tmp_path):
    _need_tritonserver()
    from splitfuse import LLM, SamplingParams
    from splitfuse.launcher import serve

    turns = _turns()
    offline = LLM(tiny_llama, **engine_kwargs(tiny_llama, ENGINE_PARAMS))  # no tiers, a pool that keeps all
    reference = [o.token_ids for o in offline.generate(turns, SamplingParams(max_tokens=4, temperature=0.0,
                                                                            ignore_eos=True))]
    offline.shutdown()
    params = {**ENGINE_PARAMS, "num_kv_blocks": str(POOL_BLOCKS), "max_model_len": str(POOL_BLOCKS * BLOCK),
              "kv_offload_memory_gb": "0.00004", "kv_offload_dir": str(tmp_path / "kv-tier")}
    with serve(tiny_llama, params, instances=2, workdir=tmp_path / "run") as server:
        served = []
        for prompt in turns:  # one after another: each turn finds the pool churned by the others
            r = grpc_generate(server.grpc_url, "llm", {"input_ids": prompt, **GREEDY})
            assert r.error is None, r.error
            served.append(r.output_ids)
        assert served == reference
        # The replicas publish their metrics every 0.5 s.
        wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_kv_tier_restored_tokens_total") > 0, timeout=5)
        memory = metric_sum(server.metrics_url, "splitfuse_kv_tier_memory_hits_total")
        disk = metric_sum(server.metrics_url, "splitfuse_kv_tier_disk_hits_total")
        restored = metric_sum(server.metrics_url, "splitfuse_kv_tier_restored_tokens_total")
        # Turns 2 and 3 found their history in a tier (a RAM tier of ~5 blocks: most went down to disk).
        assert memory + disk > 0 and restored == (memory + disk) * BLOCK, (memory, disk, restored)
        assert any((tmp_path / "kv-tier").rglob("*")), "the disk tier holds the evicted blocks"
        print(f"\ntier hits: memory {memory:.0f}, disk {disk:.0f} blocks; {restored:.0f} prompt tokens restored")
        server.stop()
