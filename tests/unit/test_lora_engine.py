"""Multi-LoRA plumbing around the model: config, requests, scheduling within max_loras, prefix
cache keys, the per-step row groups and the grouped delta itself."""

import numpy as np
import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.block_manager import BlockManager, root_hash
from splitfuse.config import EngineConfig
from splitfuse.lora.adapter import LoraAdapter, LoraPart, ProjectionLora
from splitfuse.lora.batching import LoraProjection, LoraRows, LoraState
from splitfuse.scheduler import Scheduler
from splitfuse.sequence import Sequence


# ---- config -----------------------------------------------------------------------------------
def test_lora_modules_parsed_in_order():
    config = EngineConfig.from_strings({"model": "/m", "lora_modules": "sql=/a, chat.v2=/b", "max_loras": "2",
                                        "max_lora_rank": "16"})
    assert config.lora_adapters() == {"sql": "/a", "chat.v2": "/b"}
    assert (config.max_loras, config.max_lora_rank) == (2, 16)
    assert EngineConfig(model="/m").lora_adapters() == {}


@pytest.mark.parametrize("values,message", [
    ({"lora_modules": "sql"}, "lora_modules: 'sql' is not name=path"),
    ({"lora_modules": "=/a"}, "lora_modules: adapter name ''"),
    ({"lora_modules": "a b=/a"}, "lora_modules: adapter name 'a b'"),
    ({"lora_modules": "x" * 65 + "=/a"}, "lora_modules: adapter name"),
    ({"lora_modules": "a=/x,a=/y"}, "lora_modules: adapter name 'a' is given twice"),
    ({"max_loras": "0"}, "max_loras"),
    ({"max_lora_rank": "-1"}, "max_lora_rank"),
    ({"lora_modules": "a=/x", "tensor_parallel_size": "2"}, "lora_modules .*tensor_parallel_size"),
    ({"lora_modules": "a=/x", "speculative_method": "draft", "speculative_model": "/d"},
     "lora_modules .*speculative_method=draft"),
])
def test_bad_lora_config_names_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_strings({"model": "/m", **values})


def test_lora_name_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match="lora_name"):
        SamplingParams(lora_name="")


def test_unknown_adapter_refused(tiny_llama):
    llm = LLM(tiny_llama, attention_backend="torch")
    assert llm.engine.lora_names() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'; no LoRA adapters are configured"):
        llm.generate([1, 2, 3], SamplingParams(lora_name="x"))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'"):
        llm.engine.add_prepared("r", [1, 2, 3], SamplingParams(lora_name="x"))
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.lora_stats()
    assert (stats.configured, stats.resident, stats.loads, stats.requests) == ([], [], 0, {})


# ---- scheduling and prefix-cache keys ----------------------------------------------------------
def _seq(i: int, lora: str | None) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(lora_name=lora), arrival=i)


def test_running_sequences_use_at_most_max_loras_adapters():
    sched = Scheduler(BlockManager(64, 4), token_budget=64, max_num_seqs=8, policy="splitfuse", max_loras=2)
    seqs = [_seq(0, "a"), _seq(1, None), _seq(2, "b"), _seq(3, "a"), _seq(4, "c"), _seq(5, "b")]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # "c" would be a third adapter: it waits at the head, and FIFO keeps "b" behind it waiting too.
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1", "r2", "r3"]
    sched.finish(seqs[2])  # b's only running sequence
    out = sched.schedule()
    assert seqs[4] in [c.seq for c in out.chunks] and seqs[5] not in sched.running
    sched.finish(seqs[0])
    sched.finish(seqs[3])  # a is gone: b may run beside c
    sched.schedule()
    assert seqs[5] in sched.running


def test_prefix_chains_are_keyed_by_adapter_and_salt():
    roots = {root_hash(None), root_hash(None, "a"), root_hash(None, "b"), root_hash("s"), root_hash("s", "a"),
             root_hash("a")}
    assert len(roots) == 6
    assert root_hash("s") == root_hash("s", None)  # salted chains as before


def test_blocks_of_one_adapter_are_not_found_by_another():
    blocks = BlockManager(16, 4)
    first = _seq(0, "a")
    blocks.grow(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    blocks.cache_computed_blocks(first, 0)
    assert blocks.lookup(_seq(1, "a")) == first.block_table[:1]
    assert blocks.lookup(_seq(2, "b")) == [] and blocks.lookup(_seq(3, None)) == []


# ---- row groups and the grouped delta ----------------------------------------------------------
def test_rows_grouped_by_adapter():
    rows = LoraRows.build(["b", None, "a", "b"], np.array([2, 3, 1, 2]), sample_rows=np.array([1, 4, 5, 7]),
                          device=torch.device("cpu"))
    assert rows.names == ["a", "b"] and rows.num_rows == 8 and rows.num_kept == 4
    assert [r.tolist() for r in rows.rows] == [[5], [0, 1, 6, 7]]
    assert [r.tolist() for r in rows.kept_rows] == [[2], [0, 3]]
    only = LoraRows.build(["a", "a"], np.array([2, 1]), None, torch.device("cpu"))
    assert only.rows == [None] and only.kept_rows is None  # every row one adapter's: no gather
    assert LoraRows.build([None, None], np.array([1, 1]), None, torch.device("cpu")) is None


def _adapter(name: str, in_f: int, out_sizes: list[int], parts: list[int], rank: int, gen) -> LoraAdapter:
    """One fused projection adapting the parts `parts` of outputs `out_sizes` (e.g. q, k, v)."""
    offsets = np.cumsum([0, *out_sizes])
    a = torch.randn(in_f, rank * len(parts), generator=gen)
    lora_parts = [LoraPart(int(offsets[p]), int(offsets[p + 1]), i * rank, (i + 1) * rank,
                           torch.randn(rank, out_sizes[p], generator=gen)) for i, p in enumerate(parts)]
    projection = ProjectionLora(a=a, parts=lora_parts, out_features=int(offsets[-1]))
    return LoraAdapter(name, "/x", rank, frozenset(), {(0, "qkv_proj"): projection})


def _reference_delta(x: torch.Tensor, adapter: LoraAdapter, out_features: int) -> torch.Tensor:
    """Row by row: a token's delta is x @ A_j^T @ B_j^T on each adapted part's columns."""
    p = adapter.projections[(0, "qkv_proj")]
    out = torch.zeros(x.shape[0], out_features)
    for part in p.parts:
        out[:, part.out_start:part.out_end] = x @ p.a[:, part.rank_start:part.rank_end] @ part.b
    return out


def test_grouped_delta_matches_per_token_reference():
    gen = torch.Generator().manual_seed(0)
    sizes = [8, 4, 4]
    adapters = [_adapter("q_v", 6, sizes, [0, 2], 3, gen), _adapter("all", 6, sizes, [0, 1, 2], 2, gen)]
    seq_names = ["all", None, "q_v", "all"]
    query_lens = np.array([3, 2, 1, 2])
    rows = LoraRows.build(seq_names, query_lens, sample_rows=np.array([2, 4, 5, 7]), device=torch.device("cpu"))
    state = LoraState()
    by_name = {a.name: a for a in adapters}
    state.set_step([by_name[n] for n in rows.names], rows)
    hook = LoraProjection(0, "qkv_proj", state)
    token_names = np.repeat(seq_names, query_lens)
    for kept in (None, np.array([2, 4, 5, 7])):
        names = token_names if kept is None else token_names[kept]
        x = torch.randn(len(names), 6, generator=gen)
        base = torch.randn(len(names), 16, generator=gen)
        got = hook(x, base.clone())
        for t, name in enumerate(names):
            want = base[t] if name is None else base[t] + _reference_delta(x[t:t + 1], by_name[name], 16)[0]
            torch.testing.assert_close(got[t], want, msg=f"row {t} ({name}) kept={kept is not None}")
    with pytest.raises(RuntimeError, match="LoRA: an input of 5 rows"):
        hook(torch.randn(5, 6), torch.randn(5, 16))
    state.clear()
    base = torch.randn(8, 16)
    assert torch.equal(hook(torch.randn(8, 6), base.clone()), base)
