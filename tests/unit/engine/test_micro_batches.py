"""A step cut into micro-batches for pipeline stages (engine/micro_batches.py): contiguous groups
of whole chunks, about equal in tokens, whose sampling rows concatenated are the whole batch's;
and the forward pass over the micro-batches, one after another, gives the whole batch's logits."""

from __future__ import annotations

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.micro_batches import MicroBatches, split_chunks


@pytest.fixture(scope="module")
def mixed_step(tiny_llama):
    """An engine one step in and its next step's chunks: decodes and prompt chunks."""
    llm = LLM(tiny_llama, dtype="float32", token_budget=48, block_size=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate([5, 3, 70, 9, 40]):
        engine.add_prepared(f"r{i}", [3 + (7 * i + j) % 200 for j in range(n)], params)
    engine.step()
    return engine, engine.scheduler.schedule().chunks


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9])
def test_groups_are_contiguous_non_empty_and_about_equal(mixed_step, count):
    _, chunks = mixed_step
    groups = split_chunks(chunks, count)
    assert [c for g in groups for c in g] == chunks
    assert all(groups) and len(groups) == min(count, len(chunks))
    sizes = [sum(c.num_tokens for c in g) for g in groups]
    biggest = max(c.num_tokens for c in chunks)
    assert max(sizes) - min(sizes) <= biggest, sizes  # no group more than one chunk off another


def test_micro_batches_run_one_after_another_give_the_whole_batchs_logits(mixed_step):
    engine, chunks = mixed_step
    runner = engine.runner
    whole = RaggedBatch.build(chunks, 4, runner.device)
    parts = MicroBatches.build(chunks, 4, runner.device, 2, lambda group: None)
    assert len(parts.parts) == 2 and parts.num_tokens == whole.num_tokens
    # The same step twice writes the same K/V into the same slots: the second pass reads what the first wrote.
    expected = runner.execute(whole)
    got = torch.cat([runner.execute(part) for part in parts.parts])
    assert sum(p.sample_rows.numel() for p in parts.parts) == whole.sample_rows.numel()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
