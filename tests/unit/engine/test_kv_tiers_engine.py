"""The prefix cache's tiers below the KV pool, through the engine: greedy outputs identical with
the tiers on and off on a pool so small that shared prefixes are evicted between requests, while
the tier counters show the restores happened; a damaged disk block recomputed; replicas sharing a
disk folder; salts and adapters kept apart; the settings' refusals."""

import os
import random

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.config import EngineConfig
from splitfuse.engine.block_manager import BlockManager, chain_hash, root_hash
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.sequence import Sequence
from splitfuse.kv_tiers.block_codec import decode

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TIER_FIELDS = ("kv_tier_memory_hits", "kv_tier_disk_hits", "kv_tier_restored_tokens", "kv_tier_restored_bytes",
               "kv_tier_offloaded_bytes", "kv_tier_corrupt_blocks", "prefix_cache_hits")


def chats(block_size: int, seed: int = 0) -> list[list[int]]:
    """Three conversations of three turns, taken in turn: each turn resends its conversation's
    history (4 blocks) plus a few new tokens, and the two other conversations pass between."""
    rng = random.Random(seed)
    histories = [[1] + [rng.randrange(3, 250) for _ in range(4 * block_size - 1)] for _ in range(3)]
    return [h + [rng.randrange(3, 250) for _ in range(3 + turn)] for turn in range(3) for h in histories]


def engine(tiny_llama, block_size: int = 16, **tiers) -> LLMEngine:
    # 7 blocks: one conversation's turn (5 blocks) fits; the others' blocks are evicted by then.
    return LLMEngine(EngineConfig(model=tiny_llama, attention_backend="torch", block_size=block_size,
                                  num_kv_blocks=7, token_budget=48, **tiers))


def serve(eng: LLMEngine, prompts: list[list[int]], params=GREEDY) -> tuple[list[list[int]], dict[str, float]]:
    """Each prompt alone, one after the other; the outputs and the summed step counters."""
    outputs, totals = [], dict.fromkeys(TIER_FIELDS, 0)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outputs.append(out.token_ids)
            eng.check_invariants()
            for name in TIER_FIELDS:
                totals[name] += getattr(eng.last_step, name) if eng.last_step else 0
    return outputs, totals


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Outputs without tiers, and the pool hits they had (few: the pool churns)."""
    return serve(engine(tiny_llama), chats(16))


@pytest.mark.parametrize("tiers", [
    {"kv_offload_memory_gb": 0.01},
    {"disk": True},
    {"kv_offload_memory_gb": 2e-5, "disk": True},  # 2 blocks (8 KiB each) in RAM, the rest pushed to disk
], ids=["memory", "disk", "memory+disk"])
def test_outputs_identical_with_tiers_and_restores_counted(tiny_llama, tmp_path, reference, tiers):
    tiers = dict(tiers)
    if tiers.pop("disk", False):
        tiers["kv_offload_dir"] = str(tmp_path)
    eng = engine(tiny_llama, **tiers)
    outputs, totals = serve(eng, chats(16))
    assert outputs == reference[0]
    # Turns 2 and 3 of each conversation find its 4 history blocks (3 of them past the pool: the
    # pool kept none of them, as the reference's few hits show).
    assert reference[1]["prefix_cache_hits"] == 0
    assert totals["kv_tier_restored_tokens"] == 6 * 4 * 16
    hits = totals["kv_tier_memory_hits"] + totals["kv_tier_disk_hits"]
    assert hits == 6 * 4 and totals["kv_tier_corrupt_blocks"] == 0
    if "kv_offload_dir" in tiers:
        assert totals["kv_tier_disk_hits"] > 0
    else:
        assert totals["kv_tier_disk_hits"] == 0
    assert totals["kv_tier_offloaded_bytes"] > 0 and totals["kv_tier_restored_bytes"] > 0
    stats = eng.stats()
    assert (stats.kv_tier_memory_bytes > 0) == ("kv_offload_memory_gb" in tiers)
    assert (stats.kv_tier_disk_bytes > 0) == ("kv_offload_dir" in tiers)


@pytest.mark.parametrize("block_size", [16, 8])
def test_llm_generate_with_tiers_equals_without(tiny_llama, tmp_path, block_size):
    prompts = chats(block_size, seed=block_size)
    kw = dict(attention_backend="torch", block_size=block_size, num_kv_blocks=7, token_budget=48)
    off = LLM(tiny_llama, **kw)
    on = LLM(tiny_llama, kv_offload_memory_gb=0.01, kv_offload_dir=str(tmp_path), **kw)
    outs_off = [off.generate(p, GREEDY)[0] for p in prompts]
    outs_on = [on.generate(p, GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    # Restored tokens count as cached for the request (later turns: their 4 history blocks).
    assert [o.num_cached_tokens for o in outs_on[3:]] == [4 * block_size] * 6
    assert all(o.num_cached_tokens == 0 for o in outs_off)


def test_damaged_disk_blocks_are_deleted_counted_and_recomputed(tiny_llama, tmp_path, reference):
    """Turn 1 of every conversation fills the disk; then one conversation's second block is
    flipped and another's third truncated: their turns restore up to the damage and compute
    the rest, with the same outputs."""
    prompts = chats(16)
    eng = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    first, _ = serve(eng, prompts[:3])
    folder = eng.offload.store.disk.dir

    def block_file(conversation: int, index: int) -> str:
        h = root_hash(None)
        for i in range(index + 1):
            h = chain_hash(h, prompts[conversation][16 * i : 16 * (i + 1)])
        return os.path.join(folder, h.hex())

    flipped, truncated = block_file(0, 1), block_file(1, 2)
    data = bytearray(open(flipped, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(flipped, "wb").write(bytes(data))
    open(truncated, "r+b").truncate(100)
    rest, totals = serve(eng, prompts[3:])
    assert first + rest == reference[0]
    assert totals["kv_tier_corrupt_blocks"] == 2
    # Deleted when found, then computed again and, evicted once more, written whole.
    for path in (flipped, truncated):
        decode(open(path, "rb").read(), eng.offload.fingerprint)
    # 6 later turns x 4 blocks, less what the damage cut off in turns 2 (conversations 0 and 1:
    # 3 and 2 blocks) — turn 3 restores them again, recomputed and offloaded since.
    assert totals["kv_tier_restored_tokens"] == (6 * 4 - 3 - 2) * 16


def test_replicas_share_a_disk_folder(tiny_llama, tmp_path, reference):
    """One replica's evicted prefixes serve another's requests (two engines, one folder)."""
    prompts = chats(16)
    a = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    b = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    first, _ = serve(a, prompts[:3])
    first += serve(a, [[2] * 100])[0][:0]  # pushes a's last conversation out of its pool too
    rest, totals = serve(b, prompts[3:6])
    assert first + rest == reference[0][:6]
    assert totals["kv_tier_disk_hits"] == 3 * 4


def test_salts_and_adapters_never_hit_each_others_blocks(tiny_llama):
    prompt = chats(16)[0]
    salted = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt="a")
    eng = engine(tiny_llama, kv_offload_memory_gb=0.01)
    serve(eng, [prompt], salted)
    serve(eng, [chats(16, seed=1)[0], chats(16, seed=2)[0]])  # evicts it from the pool
    for salt, hits in [("b", 0), (None, 0), ("a", 4)]:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt)
        _, totals = serve(eng, [prompt], params)
        assert totals["kv_tier_memory_hits"] == hits, salt
        serve(eng, [chats(16, seed=1)[0], chats(16, seed=2)[0]])
    # Adapters: the chain of the same tokens under another adapter (or none) starts elsewhere, so
    # a tier holding one never answers for the other.
    blocks = BlockManager(16, 16)
    base, lora = (Sequence(str(n), prompt, SamplingParams(lora_name=n), arrival=0) for n in (None, "x"))
    held = set(blocks.tier_candidates(base, 0))
    assert len(held) == 4 and not held & set(blocks.tier_candidates(lora, 0))


@pytest.mark.parametrize("values,message", [
    ({"kv_offload_memory_gb": -1.0}, "kv_offload_memory_gb"),
    ({"kv_offload_disk_gb": -1.0}, "kv_offload_disk_gb"),
    ({"kv_offload_dir": "/tmp/x", "kv_offload_disk_gb": 0.0}, "kv_offload_disk_gb"),
    ({"kv_offload_memory_gb": 1.0, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offload_memory_gb": 1.0, "tensor_parallel_size": 2}, "tensor_parallel_size.*shard"),
    ({"kv_offload_dir": "/tmp/x", "pipeline_parallel_size": 2}, "kv_offload_dir.*stage"),
    ({"kv_offload_dir": "/tmp/x", "lora_modules": "a=/p"}, "kv_offload_dir.*lora_modules"),
])
def test_refusals_name_the_setting(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **values)


def test_settings_parse_and_default_off():
    config = EngineConfig.from_strings({"model": "/m", "kv_offload_memory_gb": "2.5", "kv_offload_dir": "/tmp/t"})
    assert (config.kv_offload_memory_gb, config.kv_offload_dir, config.kv_offload_disk_gb) == (2.5, "/tmp/t", 4.0)
    assert config.kv_offload_tiers and not EngineConfig(model="/m").kv_offload_tiers
