"""RaggedBatch's sample rows, and the last layer computing only them."""

from __future__ import annotations

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import paged_attention as cpu_attention
from splitfuse.engine.batch import RaggedBatch

BACKENDS = [pytest.param("torch"),
            pytest.param("cpu", marks=pytest.mark.skipif(not cpu_attention.available(), reason="no C++ kernels"))]


def _mixed_step(path: str, backend: str):
    """An engine one step in, and its next batch: decodes, a prompt chunk that samples and
    prompt chunks that do not (their prompts go on in later steps)."""
    llm = LLM(path, dtype="float32", token_budget=48, block_size=4, attention_backend=backend)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate([5, 3, 70, 9, 40]):
        engine.add_prepared(f"r{i}", [3 + (7 * i + j) % 200 for j in range(n)], params)
    engine.step()
    chunks = engine.scheduler.schedule().chunks
    return engine, chunks, RaggedBatch.build(chunks, 4, engine.runner.device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_rows_metadata(tiny_llama, backend):
    _, chunks, batch = _mixed_step(tiny_llama, backend)
    sampling = [c for c in chunks if c.samples]
    assert sampling and len(sampling) < len(chunks), "the step should mix sampling and non-sampling chunks"
    qsl = batch.attn.query_start_loc.tolist()
    expected_rows = [qsl[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
    assert batch.sample_rows.tolist() == expected_rows
    last = batch.last_layer
    assert last is not None
    assert last.query_lens == [1] * len(sampling)
    assert last.seq_lens == [c.seq.num_computed_tokens + c.num_tokens for c in sampling]
    meta = last.attn
    assert meta.query_start_loc.tolist() == list(range(len(sampling) + 1))
    assert meta.seq_lens.tolist() == last.seq_lens
    keep = [i for i, c in enumerate(chunks) if c.samples]
    assert torch.equal(meta.block_tables, batch.attn.block_tables[keep])
    assert torch.equal(meta.slot_mapping, batch.attn.slot_mapping[batch.sample_rows])


@pytest.mark.parametrize("backend", BACKENDS)
@torch.inference_mode()
def test_last_layer_keeps_only_the_sample_rows(tiny_llama, backend):
    engine, _, batch = _mixed_step(tiny_llama, backend)
    runner = engine.runner
    kept = runner.forward_hidden(batch)
    # Every row through every layer (and the same K/V written again).
    runner.kernels.attention.prepare(batch.attn, batch.query_lens, batch.seq_lens, runner.args.num_kv_heads)
    full = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches, runner.cos, runner.sin)
    assert full.shape[0] == batch.num_tokens and kept.shape[0] == batch.sample_rows.numel()
    torch.testing.assert_close(kept, full.index_select(0, batch.sample_rows), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.inference_mode()
def test_a_step_of_decodes_runs_every_row_as_it_is(tiny_llama, backend):
    engine, _, _ = _mixed_step(tiny_llama, backend)
    for _ in range(20):  # until every running sequence decodes
        engine.step()
        chunks = engine.scheduler.schedule().chunks
        if chunks and all(c.num_tokens == 1 and c.samples for c in chunks):
            break
    else:
        pytest.fail("no step of decodes only")
    batch = RaggedBatch.build(chunks, 4, engine.runner.device)
    assert batch.last_layer is None and batch.sample_rows.tolist() == list(range(batch.num_tokens))
    runner = engine.runner
    kept = runner.forward_hidden(batch)
    full = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches, runner.cos, runner.sin)
    assert torch.equal(kept, full)
