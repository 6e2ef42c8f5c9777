"""Pipeline parallelism on CPU with gloo: greedy tokens with pipeline_parallel_size=2 (two steps
in flight) equal those with one stage (itself held to HF transformers by test_parity.py), fp32, through mixed batches, a
small token budget, preemption, aborts and prefix-cache hits; Llama with three layers (an uneven
split: 1 + 2, the second stage running two layers in one fused C++ call), Qwen2 with a tied LM
head (the last stage keeps the embedding's table for it) and Mixtral. One two-rank engine per
architecture (pp=2 x tp=2: tests/unit/parallel/test_pipeline_stages.py)."""

import json
import random

import pytest

from splitfuse import LLMEngine, SamplingParams
from splitfuse.config import EngineConfig

# Two-rank engines (processes) per architecture (make test-fast leaves it out).
pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [1, 2, 5, 9, 17, 33, 70]
SHARED = 24  # tokens the last two prompts share with the longest one: prefix-cache hits
ENGINE = dict(dtype="float32", token_budget=12, block_size=4, num_kv_blocks=24, num_threads=2)

CASES = {
    "llama-3-layers": dict(arch="llama", num_hidden_layers=3),
    "qwen2-tied-head": dict(arch="qwen2", tie_word_embeddings=True),
    "mixtral": dict(arch="mixtral"),
}


def _max_tokens(i: int) -> int:
    return 5 + (i * 5) % 11


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in PROMPT_LENGTHS]
    longest = prompts[-1]
    return prompts + [longest[:SHARED] + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 9)]


def _run(engine: LLMEngine, prompts: list[list[int]], abort: set[int] = frozenset()) -> tuple[dict, int, int]:
    """Run every prompt to its end (the prompts sharing a prefix after the others, so that the
    cache holds it), aborting those in `abort` after their third token. Returns {index: tokens}
    of the others, the preemptions and the prefix-cache hits seen."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    finished: dict[int, list[int]] = {}
    preemptions = hits = 0
    for wave in (range(len(PROMPT_LENGTHS)), range(len(PROMPT_LENGTHS), len(prompts))):
        for i in wave:
            engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=_max_tokens(i), temperature=0.0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = int(out.request_id[1:])
                tokens[i] += out.delta_token_ids
                if out.finished:
                    finished[i] = tokens[i]
                elif i in abort and len(tokens[i]) >= 3:
                    assert engine.abort_request(out.request_id).finish_reason == "abort"
            if engine.last_step is not None:
                preemptions += engine.last_step.num_preemptions
                hits += engine.last_step.prefix_cache_hits
    engine.check_invariants()
    assert engine.blocks.num_used_blocks == 0
    return {i: t for i, t in finished.items() if i not in abort}, preemptions, hits


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory):
    spec = dict(CASES[request.param])
    path = tiny_model_factory(spec.pop("arch"), **spec)
    prompts = _prompts(json.loads(open(f"{path}/config.json").read())["vocab_size"])
    engine = LLMEngine(EngineConfig(model=path, pipeline_parallel_size=2, **ENGINE))
    yield request.param, path, prompts, engine
    engine.shutdown()


def test_two_stages_match_one_stage(case):
    name, path, prompts, pp2 = case
    # One thread: the many tiny OpenMP regions of the tiny MoE crawl with two on a busy machine.
    one, _, one_hits = _run(LLMEngine(EngineConfig(model=path, **(ENGINE | dict(num_threads=1)))), prompts)
    two, preemptions, hits = _run(pp2, prompts)
    assert preemptions > 0, "the KV pool was meant to be small enough to preempt"
    # Two steps in flight schedule differently from one stage (not the same preemptions): both hit.
    assert hits > 0 and one_hits > 0, "the prompts sharing a prefix were meant to hit the cache"
    assert set(two) == set(one) == set(range(len(prompts)))
    for i in one:
        assert two[i] == one[i], f"{name}: pp=2 prompt#{i} (len {len(prompts[i])})"


def test_two_stages_with_aborts(case):
    """Aborted requests free their blocks on rank 0 and the others go on unchanged: both stages'
    caches stay consistent with the block tables rank 0 sends."""
    name, _, prompts, pp2 = case
    expected, _, _ = _run(pp2, prompts)
    got, _, _ = _run(pp2, prompts, abort={1, 4, 6})
    assert set(got) == set(expected) - {1, 4, 6}
    for i in got:
        assert got[i] == expected[i], f"{name}: prompt#{i} after aborts"


def test_rank_0_holds_the_first_stage_only(case):
    """Stage 0 (rank 0) holds the embedding and its layers' KV cache, no final norm and no LM head
    (the last stage's); its block count is the one every stage builds."""
    name, path, _, pp2 = case
    num_layers = json.loads(open(f"{path}/config.json").read())["num_hidden_layers"]
    runner = pp2.runner
    assert (runner.layers.first, runner.layers.end) == (0, num_layers // 2)
    assert len(runner.kv_caches) == len(runner.model.model.layers) == num_layers // 2
    assert runner.model.lm_head is None and runner.model.model.norm is None
    assert runner.model.model.embed_tokens is not None
    assert runner.num_kv_blocks == ENGINE["num_kv_blocks"] == pp2.blocks.num_blocks


def test_two_steps_in_flight_each_go_in_one_micro_batch(case):
    """Two steps are in flight at once (pipeline_steps_in_flight = the stages), each one micro-batch
    (with one step at a time, each step is cut in two: tests/unit/parallel/test_pipeline_stages.py).
    A step alone is collected once the next is launched or nothing else can run: its sequence
    waits for the token in flight."""
    from splitfuse.engine.micro_batches import MicroBatches

    _, _, prompts, pp2 = case
    pp2.add_request("alone", prompts[3], SamplingParams(max_tokens=2, temperature=0.0))
    plan = pp2.schedule()
    assert isinstance(plan.batch, MicroBatches) and len(plan.batch.parts) == 1
    assert pp2.execute(plan) == [] and pp2.num_steps_in_flight == 1
    assert pp2.schedule().batch is None, "its sequence waits for the token in flight"
    while not pp2.step():  # collects it
        pass
    for i in (4, 5):
        pp2.add_request(f"m{i}", prompts[i], SamplingParams(max_tokens=2, temperature=0.0))
    plan = pp2.schedule()
    assert len(plan.decision.chunks) >= 2 and len(plan.batch.parts) == 1
    assert plan.batch.num_tokens == ENGINE["token_budget"]
    pp2.execute(plan)
    while pp2.has_unfinished_requests():
        pp2.step()
    assert pp2.blocks.num_used_blocks == 0


def test_an_embedding_request_is_refused_naming_the_pipeline(case):
    """The first stage holds no final hidden states to pool: refused before it is queued."""
    _, _, prompts, pp2 = case
    with pytest.raises(ValueError, match="embed: .*pipeline_parallel_size"):
        pp2.add_request("embed", prompts[0], SamplingParams(embed=True))
    assert not pp2.has_unfinished_requests()
