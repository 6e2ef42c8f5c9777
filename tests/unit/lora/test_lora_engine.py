"""Multi-LoRA plumbing around the model: config, requests, scheduling within max_loras, prefix
cache keys, the per-step row groups and the grouped delta itself."""

import functools

import numpy as np
import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.engine.block_manager import BlockManager, root_hash
from splitfuse.config import EngineConfig
from splitfuse.kernels.cpu import linear as cpu_linear
from splitfuse.layers.linear import make_linear_kernel
from splitfuse.lora import batching
from splitfuse.lora.adapter import BaseShape, LoraAdapter, LoraPart, ProjectionLora
from splitfuse.lora.batching import LoraProjection, LoraRows, LoraState
from splitfuse.lora.stacks import LoraStacks
from splitfuse.engine import scheduler
from splitfuse.engine.scheduler import Scheduler
from splitfuse.engine.sequence import Sequence, SequenceStatus


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
    # "c" would be a third adapter: it waits, and "b" (running) is admitted past it.
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1", "r2", "r3", "r5"]
    assert list(sched.waiting) == [seqs[4]]
    sched.finish(seqs[2])
    sched.finish(seqs[5])  # b's running sequences are done: c takes its slot
    out = sched.schedule()
    assert seqs[4] in [c.seq for c in out.chunks]
    assert set(sched._running_loras) == {"a", "c"}


def _step(sched: Scheduler, max_tokens: int) -> list[str]:
    """One step as the engine runs it: sampled chunks append a token; sequences with `max_tokens`
    generated finish. Returns the request ids that ran."""
    out = sched.schedule()
    sampling = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    for seq in sampling:
        seq.append_token(7)
        if seq.num_tokens - seq.num_prompt_tokens >= max_tokens:
            sched.finish(seq)
    return [c.seq.request_id for c in out.chunks]


def test_adapter_waiting_for_a_slot_does_not_block_the_queue_nor_starve():
    """max_loras=1 with adapter "a" always busy: a request of "b" waits for the slot, base and "a"
    requests behind it are admitted past it, and "b" still runs once it has waited LORA_BYPASS_STEPS
    steps (no new "a" sequence is admitted past it then, so "a" drains)."""
    sched = Scheduler(BlockManager(256, 4), token_budget=32, max_num_seqs=8, policy="splitfuse", max_loras=1)
    n = iter(range(10_000))
    sched.add(_seq(next(n), "a"))
    blocked = _seq(next(n), "b")
    sched.add(blocked)
    behind = [_seq(next(n), None), _seq(next(n), "a")]
    for s in behind:
        sched.add(s)
    ran = _step(sched, max_tokens=6)
    assert {s.request_id for s in behind} <= set(ran) and blocked.request_id not in ran
    waited = 0
    while blocked.status is not SequenceStatus.RUNNING:
        # A steady stream of "a" (and base) requests that would keep "a" running forever.
        sched.add(_seq(next(n), "a"))
        if waited % 2:
            sched.add(_seq(next(n), None))
        ran = _step(sched, max_tokens=6)
        waited += 1
        assert waited < scheduler.LORA_BYPASS_STEPS + 50, "the request of adapter b starved"
        if waited < scheduler.LORA_BYPASS_STEPS:  # until then "a" keeps being admitted past it
            assert sched._running_loras.get("a", 0) > 0
    assert waited > scheduler.LORA_BYPASS_STEPS // 2  # it did wait while "a" was served
    assert set(sched._running_loras) == {"b"}


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


# ---- row groups and the deltas ----------------------------------------------------------------
def test_rows_by_adapter():
    rows = LoraRows.build(["b", None, "a", "b"], np.array([2, 3, 1, 2]), sample_rows=np.array([1, 4, 5, 7]))
    assert rows.names == ["a", "b"]
    assert rows.row_adapter.tolist() == [1, 1, -1, -1, -1, 0, 1, 1]
    assert rows.kept_adapter.tolist() == [1, -1, 0, 1]
    assert LoraRows.build(["a", "a"], np.array([2, 1]), None).kept_adapter is None
    assert LoraRows.build([None, None], np.array([1, 1]), None) is None


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


# (STACKED_MAX_ROWS, RUN_MIN_ROWS) for the test's 8 rows (runs of 3, 2 base, 1, 2) and 4 kept rows
MODES = {
    "stacked": (64, 8),  # every row through the stacks
    "runs": (0, 1),  # every adapter's run a view of the input
    "gathered": (0, 100),  # no run long enough, too many rows for the stacks: gathered by adapter
    "hybrid": (4, 3),  # the run of 3 a view, the other rows through the stacks (the kept rows: all)
}


@pytest.mark.parametrize("backend", ["torch", "cpu", "onednn"])
@pytest.mark.parametrize("mode", list(MODES))
def test_deltas_match_a_per_token_reference(monkeypatch, mode, backend):
    """Every path (stacked for few rows; for many, runs as views and the other rows stacked or
    gathered), over the step's rows and the last layer's kept rows: each row gets its own
    adapter's delta on its parts' columns only."""
    monkeypatch.setattr(batching, "STACKED_MAX_ROWS", MODES[mode][0])
    monkeypatch.setattr(batching, "RUN_MIN_ROWS", MODES[mode][1])
    gen = torch.Generator().manual_seed(0)
    sizes = [8, 4, 4]
    adapters = [_adapter("q_v", 6, sizes, [0, 2], 3, gen), _adapter("all", 6, sizes, [0, 1, 2], 2, gen),
                _adapter("k", 6, sizes, [1], 4, gen)]
    shape = BaseShape(num_layers=1, hidden_size=6, q_size=8, kv_size=4, intermediate_size=8)
    available = {"torch": lambda: True, "cpu": cpu_linear.available, "onednn": torch.backends.mkldnn.is_available}
    if not available[backend]():
        pytest.skip(f"no {backend} linear kernel here")
    make_kernel = functools.partial(make_linear_kernel, bias=None, backend=backend)
    stacks = LoraStacks(adapters, shape, max_loras=3, dtype=torch.float32, device=torch.device("cpu"),
                        make_kernel=make_kernel)
    # Slots out of order, and "k" resident but unused this step: its slot must give nothing.
    slots = {"all": 2, "q_v": 0, "k": 1}
    for adapter in adapters:
        stacks.write(slots[adapter.name], adapter.pack(make_kernel))
    stacks.pack()
    by_name = {a.name: a for a in adapters}
    seq_names = ["all", None, "q_v", "all"]
    query_lens = np.array([3, 2, 1, 2])
    rows = LoraRows.build(seq_names, query_lens, sample_rows=np.array([2, 4, 5, 7]))
    state = LoraState(stacks)
    step_adapters = [by_name[n] for n in rows.names]
    state.set_step(step_adapters, [slots[a.name] for a in step_adapters], rows, torch.device("cpu"))
    hook = LoraProjection(0, "qkv_proj", state)
    full = state.rows(8)
    assert {"stacked": full.stacked, "runs": all(isinstance(g, slice) for _, g in full.groups) and not full.stacked,
            "gathered": any(isinstance(g, torch.Tensor) for _, g in full.groups),
            "hybrid": full.scattered is not None and len(full.groups) == 1}[mode], "the mode's path is not taken"
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


def test_stack_slot_rewritten_on_reload():
    """A slot taken over by another adapter holds only the new one's weights (zero-padded where
    its rank is smaller, zero where it lacks a part)."""
    gen = torch.Generator().manual_seed(1)
    big = _adapter("big", 6, [8, 4, 4], [0, 1, 2], 4, gen)
    small = _adapter("small", 6, [8, 4, 4], [0], 2, gen)
    shape = BaseShape(num_layers=1, hidden_size=6, q_size=8, kv_size=4, intermediate_size=8)
    stacks = LoraStacks([big, small], shape, max_loras=1, dtype=torch.float32, device=torch.device("cpu"))
    stacks.write(0, big)
    stacks.write(0, small)
    stacked = stacks.projections[(0, "qkv_proj")]
    assert stacked.layout == (4, 4, 4)
    torch.testing.assert_close(stacked.a[:, :2], small.projections[(0, "qkv_proj")].a)
    assert not stacked.a[:, 2:].any() and not stacked.parts[1].b.any() and not stacked.parts[0].b[2:].any()
