"""Top-k log-probabilities through the engine (SamplingParams.top_logprobs): the model's own
distribution, the chosen token on top under greedy, carried along when speculation accepts several
tokens in one step and when a stop cuts them, streamed deltas that add up to the whole, -inf for
the tokens a grammar refuses."""

import json
import math

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.sequence import RequestOutput
from splitfuse.structured.guide import Guide

K = 5


def stream(engine: LLMEngine,
           requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Every output of each request, stepping the engine until all have finished."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    engine.check_invariants()
    return outs


def test_greedy_top_logprobs_are_the_models_with_the_chosen_token_first(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=K, ignore_eos=True)
    out = llm.generate("hello", params)[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 6 and all(len(row) == K for row in out.top_logprobs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    for i, (token, lp, row) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        values, ids = logp[n - 1 + i].topk(K)
        assert [t for t, _ in row] == ids.tolist()
        assert [v for _, v in row] == pytest.approx(values.tolist(), abs=1e-4)
        assert row[0][0] == token and row[0][1] == pytest.approx(lp, abs=1e-6)
    # Not asking changes nothing else and carries none.
    plain = llm.generate("hello", SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True))[0]
    assert plain.token_ids == out.token_ids and plain.logprobs == pytest.approx(out.logprobs, abs=1e-6)
    assert plain.top_logprobs is None and plain.delta_top_logprobs is None


def test_speculation_carries_each_accepted_tokens_alternatives(tiny_llama):
    """ngram speculation accepts several tokens per step: each keeps its own row's top-k, the same
    as decoding one token per step (greedy, so the same tokens), also where a stop cuts a run; the
    streamed deltas add up to the whole at every step."""
    prompts = [[1] + [7, 19, 23, 5, 11] * 4, [1] + [40, 41, 42] * 5, [1, 9, 8, 7, 9, 8, 7, 9]]
    base = dict(temperature=0.0, logprobs=True, top_logprobs=K, ignore_eos=True)
    cfg = dict(token_budget=64, block_size=4, num_kv_blocks=256)
    plain_engine = LLM(tiny_llama, **cfg).engine
    requests = {str(i): (p, SamplingParams(max_tokens=24, **base)) for i, p in enumerate(prompts)}
    reference = stream(plain_engine, dict(requests))
    for i, p in enumerate(prompts):  # a stop token inside the output: a step's accepted run may be cut there
        stop = reference[str(i)][-1].token_ids[9]
        requests[f"stop{i}"] = (p, SamplingParams(max_tokens=24, stop_token_ids=[stop], **base))
    spec_engine = LLM(tiny_llama, speculative_method="ngram", num_speculative_tokens=4, **cfg).engine
    spec = stream(spec_engine, requests)
    assert spec_engine.speculation.num_accepted > 0
    assert any(len(o.delta_token_ids) > 1 for outs in spec.values() for o in outs)  # several tokens in a step
    for rid, outs in spec.items():
        final = outs[-1]
        ref = reference[rid.removeprefix("stop")][-1]
        n = len(final.token_ids)
        assert final.token_ids == ref.token_ids[:n]
        ids = [[t for t, _ in row] for row in final.top_logprobs]
        assert ids == [[t for t, _ in row] for row in ref.top_logprobs[:n]]
        for got, want in zip(final.top_logprobs, ref.top_logprobs):
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
        for row, lp in zip(final.top_logprobs, final.logprobs):
            assert row[0][1] == pytest.approx(lp, abs=1e-6)
        for j, out in enumerate(outs):  # every step's snapshot: deltas so far == everything so far
            assert len(out.delta_top_logprobs) == len(out.delta_token_ids)
            assert [r for o in outs[: j + 1] for r in o.delta_top_logprobs] == out.top_logprobs
            assert len(out.top_logprobs) == len(out.token_ids)
    for i in range(len(prompts)):
        assert spec[f"stop{i}"][-1].finish_reason == "stop" and len(spec[f"stop{i}"][-1].token_ids) <= 10


def test_sampled_and_mixed_batches(tiny_llama):
    """Sampled rows get alternatives too, each request its own k, requests that do not ask none."""
    engine = LLM(tiny_llama, token_budget=64, block_size=4, num_kv_blocks=128).engine
    outs = stream(engine, {
        "k1": ([1, 5, 9], SamplingParams(max_tokens=8, temperature=0.9, seed=3, top_logprobs=1, ignore_eos=True)),
        "k20": ([1, 6, 2], SamplingParams(max_tokens=8, temperature=1.2, top_k=4, top_logprobs=20, ignore_eos=True)),
        "none": ([1, 7, 3], SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)),
    })
    for rid, k in (("k1", 1), ("k20", 20)):
        final = outs[rid][-1]
        assert len(final.top_logprobs) == 8 and all(len(row) == k for row in final.top_logprobs)
        for row in final.top_logprobs:
            values = [v for _, v in row]
            assert values == sorted(values, reverse=True) and all(v <= 0.0 and math.isfinite(v) for v in values)
            assert all(0 <= t < engine.vocab_size for t, _ in row)
            assert len({t for t, _ in row}) == k
    assert outs["none"][-1].top_logprobs is None and all(o.delta_top_logprobs is None for o in outs["none"])


def test_tokens_a_grammar_refuses_have_minus_infinity(tiny_llama):
    llm = LLM(tiny_llama)
    options = ["alpha", "beta"]
    out = llm.generate([1, 5, 9], SamplingParams(max_tokens=20, temperature=0.0, top_logprobs=20, logprobs=True,
                                                  guide=Guide("choice", json.dumps(options))))[0]
    assert out.text in options
    first = out.top_logprobs[0]  # few tokens can start "alpha" or "beta"; the rest are refused
    assert first[-1][1] == float("-inf")
    allowed = [t for t, v in first if v != float("-inf")]
    assert out.token_ids[0] in allowed and first[0] == (out.token_ids[0], pytest.approx(out.logprobs[0], abs=1e-6))


def test_merged_outputs_keep_every_tokens_alternatives():
    """An output merged after an earlier, undelivered one (stream_interval, a slow consumer)
    carries both deltas, also when the later one has no tokens (the final output of an abort)."""
    def output(tokens, top, finished=False) -> RequestOutput:
        return RequestOutput("r", [1], tokens, "", finished, delta_logprobs=[v for _, v in top] if top else None,
                             delta_top_logprobs=[[row] for row in top] if top else None)

    first, second = output([4], [(4, -0.1)]), output([5, 6], [(5, -0.2), (6, -0.3)])
    merged = second.after(first)
    assert merged.delta_token_ids == [4, 5, 6] and merged.delta_logprobs == [-0.1, -0.2, -0.3]
    assert merged.delta_top_logprobs == [[(4, -0.1)], [(5, -0.2)], [(6, -0.3)]]
    aborted = output([], [], finished=True).after(merged)
    assert aborted.delta_top_logprobs == merged.delta_top_logprobs and aborted.delta_logprobs == merged.delta_logprobs
    assert output([], []).after(output([4], [])).delta_top_logprobs is None  # not asked for
