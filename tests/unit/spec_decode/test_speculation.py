"""Speculative decoding driven through the engine: sampled output unchanged (seeded: the same
tokens; unseeded: the same distribution), stops inside accepted runs, preemption and aborts in
the middle of speculation, the adaptive rules, KV invariants, configuration errors."""

import random

import pytest
import torch

from splitfuse import LLM, EngineConfig, SamplingParams
from splitfuse.engine.scheduler import ScheduledChunk
from splitfuse.engine.sequence import Sequence
from splitfuse.spec_decode.decoder import verified_tokens

K = 4


def repetitive_prompts(vocab: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random segment, so n-gram lookups find proposals."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        segment = [rng.randrange(3, vocab) for _ in range(3 + 4 * i)]
        prompts.append([1] + segment * 3)
    return prompts


def generate(llm: LLM, prompts, params):
    """Outputs in order, plus the engine's (proposed, accepted) totals (0, 0 without speculation)."""
    engine = llm.engine
    outs = llm.generate(prompts, params)
    engine.check_invariants()
    assert engine.blocks.num_used_blocks == 0
    spec = engine.speculation
    return outs, (spec.num_proposed if spec else 0), (spec.num_accepted if spec else 0)


@pytest.fixture(scope="module")
def vocab(tiny_llama):
    return LLM(tiny_llama).engine.vocab_size


SPEC = {
    "ngram": dict(speculative_method="ngram"),
    "draft": dict(speculative_method="draft"),  # the model itself as draft: every greedy proposal right
}


def spec_kwargs(method: str, model: str) -> dict:
    kwargs = dict(SPEC[method], num_speculative_tokens=K)
    if method == "draft":
        kwargs["speculative_model"] = model
    return kwargs


@pytest.mark.parametrize("method", list(SPEC))
def test_seeded_sampling_draws_the_same_tokens(tiny_llama, vocab, method):
    prompts = repetitive_prompts(vocab)
    # Low temperatures and small top-k, so that samples often equal the proposals.
    params = [SamplingParams(max_tokens=20, temperature=[0.2, 0.8][i % 2], top_k=[0, 3][i % 2],
                             top_p=[1.0, 0.9][i % 3 == 1], repetition_penalty=[1.0, 1.1][i % 2],
                             presence_penalty=[0.0, 0.3][i % 3 == 0], min_tokens=[0, 6][i % 2], seed=100 + i,
                             logprobs=True)
              for i in range(len(prompts))]
    plain, _, _ = generate(LLM(tiny_llama, token_budget=64, block_size=4), prompts, params)
    spec, proposed, accepted = generate(LLM(tiny_llama, token_budget=64, block_size=4,
                                            **spec_kwargs(method, tiny_llama)), prompts, params)
    assert accepted > 0 and proposed > accepted
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def _chi_square_p_value(counts_a: dict, counts_b: dict) -> float:
    """Two-sample chi-square test of homogeneity; p-value from the regularised gamma."""
    cats = sorted(set(counts_a) | set(counts_b))
    a = torch.tensor([counts_a.get(c, 0) for c in cats], dtype=torch.float64)
    b = torch.tensor([counts_b.get(c, 0) for c in cats], dtype=torch.float64)
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_unseeded_token_distribution_unchanged(tiny_llama, vocab):
    """Temperature > 0 over a small support (top_k=3): each output position's token frequencies
    with speculation match those without (chi-square, p > 0.001 with the fixed sampler seeds;
    the test is deterministic). The model drafts for itself: its greedy proposals are accepted
    about a third of the time, so both branches of the rule are exercised. Positions 2-5 are
    the verified ones."""
    n = 1500
    prompt = [1] + [7, 8, 9, 10] * 4
    params = SamplingParams(max_tokens=5, temperature=1.0, top_k=3, ignore_eos=True)
    common = dict(max_num_seqs=512, token_budget=512, seed=3)
    plain, _, _ = generate(LLM(tiny_llama, **common), [prompt] * n, params)
    spec, proposed, accepted = generate(LLM(tiny_llama, **common, **spec_kwargs("draft", tiny_llama),
                                            speculative_disable_batch_size=10_000), [prompt] * n, params)
    assert 0.1 * proposed < accepted < 0.9 * proposed, (proposed, accepted)
    for position in range(1, 5):
        counts = []
        for outs in (plain, spec):
            c: dict = {}
            for o in outs:
                c[o.token_ids[position]] = c.get(o.token_ids[position], 0) + 1
            counts.append(c)
        p = _chi_square_p_value(*counts)
        assert p > 1e-3, f"position {position}: {counts} p={p:.2g}"
    # The joint distribution of two verified positions too.
    pairs = [{}, {}]
    for c, outs in zip(pairs, (plain, spec)):
        for o in outs:
            key = tuple(o.token_ids[1:3])
            c[key] = c.get(key, 0) + 1
    assert _chi_square_p_value(*pairs) > 1e-3


def _reference_run(tiny_llama, prompts, max_tokens=24):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs, _, _ = generate(LLM(tiny_llama, token_budget=64, block_size=4), prompts, [params] * len(prompts))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", list(SPEC))
def test_stops_inside_accepted_runs_cut_where_plain_decoding_does(tiny_llama, vocab, method):
    prompts = repetitive_prompts(vocab, count=4)
    ref = _reference_run(tiny_llama, prompts)
    llm_plain = LLM(tiny_llama, token_budget=64, block_size=4)
    llm_spec = LLM(tiny_llama, token_budget=64, block_size=4, **spec_kwargs(method, tiny_llama))
    tok = llm_plain.engine.tokenizer
    cases = []
    for i, (prompt, tokens) in enumerate(zip(prompts, ref)):
        stop_at = 5 + i  # inside the first or second run of K proposals
        cases.append((prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tokens[stop_at]])))
        cases.append((prompt, SamplingParams(max_tokens=stop_at, temperature=0.0, ignore_eos=True)))
        text = tok.decode(tokens[: stop_at + 1])
        cases.append((prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                             stop=[text[-3:]] if len(text) >= 3 else [text])))
        # min_tokens masks the stop token until it is due: a different greedy path, same in both.
        cases.append((prompt, SamplingParams(max_tokens=24, temperature=0.0, min_tokens=stop_at + 2,
                                             stop_token_ids=[tokens[2]])))
    prompts_, params = zip(*cases)
    plain, _, _ = generate(llm_plain, list(prompts_), list(params))
    spec, proposed, accepted = generate(llm_spec, list(prompts_), list(params))
    assert accepted > 0
    for a, b, p in zip(plain, spec, params):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), p
        assert len(b.token_ids) <= p.max_tokens


@pytest.mark.parametrize("method", list(SPEC))
def test_preemption_and_aborts_in_the_middle_of_speculation(tiny_llama, vocab, method):
    prompts = repetitive_prompts(vocab, count=6, seed=1)
    ref = _reference_run(tiny_llama, prompts, max_tokens=30)
    # A pool that holds about two of these sequences at once: speculating ones get preempted.
    llm = LLM(tiny_llama, token_budget=16, block_size=4, num_kv_blocks=30, kv_watermark=0.0,
              **spec_kwargs(method, tiny_llama))
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finals, steps, aborted, drafted = {}, 0, set(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        engine.check_invariants()
        if method == "draft":
            engine.speculation.proposer.check_invariants()
        # Abort a request right after a step that verified proposals of it.
        if engine.last_step and engine.last_step.spec_draft_tokens:
            drafted += 1
            if drafted in (3, 9):
                victim = next((s for s in engine.scheduler.running if s.draft_token_ids), None)
                if victim is not None and victim.request_id not in aborted:
                    finals[victim.request_id] = engine.abort_request(victim.request_id)
                    aborted.add(victim.request_id)
                    engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0 and aborted
    assert engine.blocks.num_used_blocks == 0
    if method == "draft":
        assert engine.speculation.proposer.blocks.num_used_blocks == 0
    for i, tokens in enumerate(ref):
        out = finals[f"r{i}"]
        if f"r{i}" in aborted:
            assert out.finish_reason == "abort" and tokens[: len(out.token_ids)] == out.token_ids
        else:
            assert out.token_ids == tokens


def test_rejected_proposals_cost_little_and_pause(tiny_model_factory, tiny_llama, vocab):
    """A draft model that is always wrong: outputs unchanged, and after a few rejected rounds the
    sequence stops asking (paused for doubling stretches): few proposals over a long output."""
    other = tiny_model_factory("llama", seed=7)
    prompt = repetitive_prompts(vocab, count=1)[0]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    plain, _, _ = generate(LLM(tiny_llama), [prompt], [params])
    spec, proposed, accepted = generate(LLM(tiny_llama, speculative_method="draft", speculative_model=other,
                                            num_speculative_tokens=K), [prompt], [params])
    assert spec[0].token_ids == plain[0].token_ids
    assert accepted <= 0.1 * proposed
    # 3 rounds to fall below the threshold, then probes after pauses of 2, 4, ..., 64 steps.
    assert proposed <= 10 * K, proposed


def test_large_batches_do_not_speculate(tiny_llama, vocab):
    prompts = repetitive_prompts(vocab, count=6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, speculative_method="ngram", speculative_disable_batch_size=5)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step
        decodes = stats.num_tokens - stats.num_prompt_tokens - stats.spec_draft_tokens
        if stats.spec_draft_tokens:
            assert decodes <= 5


def test_configuration_errors(tiny_model_factory, tiny_llama):
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(model="/m", speculative_method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(model="/m", speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(model="/m", speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="/m", num_speculative_tokens=0)
    other_vocab = tiny_model_factory("llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama, speculative_method="draft", speculative_model=other_vocab)
    parsed = EngineConfig.from_strings({"model": "/m", "speculative_method": "ngram", "speculative_model": "",
                                        "num_speculative_tokens": "3"})
    assert (parsed.speculative_method, parsed.speculative_model, parsed.num_speculative_tokens) == ("ngram", None, 3)


def test_step_counts_only_the_tokens_kept(tiny_llama, vocab):
    """A stop inside an accepted run: the step's generated-token count (the metrics' source) is
    what the output carries, not what verification accepted."""
    prompt = repetitive_prompts(vocab, count=1)[0]
    ref = _reference_run(tiny_llama, [prompt])[0]
    llm = LLM(tiny_llama, token_budget=64, block_size=4, **spec_kwargs("draft", tiny_llama))
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[ref[6]],
                                                   ignore_eos=True))
    generated = 0
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.delta_token_ids
        generated += engine.last_step.num_generated_tokens
    assert tokens == ref[: ref.index(ref[6]) + 1] and generated == len(tokens)


def test_draft_passes_run_a_token_for_every_proposal(tiny_llama, vocab, monkeypatch):
    """A shadow whose every token is computed (its proposals were all right) runs its last
    token again: a draft chunk of no tokens has no row of its own to take the next token
    from (it took its neighbour's)."""
    from splitfuse.spec_decode import draft as spec_draft

    built = []

    def build(chunks, *args):
        built.append([c.num_tokens for c in chunks])
        return real_build(chunks, *args)

    real_build = spec_draft.RaggedBatch.build
    monkeypatch.setattr(spec_draft.RaggedBatch, "build", build)
    params = SamplingParams(max_tokens=5, temperature=1.0, top_k=3, ignore_eos=True)
    llm = LLM(tiny_llama, max_num_seqs=512, token_budget=512, seed=3, **spec_kwargs("draft", tiny_llama),
              speculative_disable_batch_size=10_000)
    generate(llm, [[1] + [7, 8, 9, 10] * 4] * 1500, params)
    assert built and all(n > 0 for chunk_tokens in built for n in chunk_tokens)


def test_verified_tokens_are_the_confirmed_proposals_then_the_sampled_token():
    seq = Sequence("r", [1, 2], SamplingParams(), arrival=0)
    seq.draft_token_ids = [7, 8, 9]
    chunk = ScheduledChunk(seq, 1, num_draft_tokens=3)
    rows = [(7, None, None), (5, None, None), RuntimeError("never read"), (4, None, None)]
    assert verified_tokens(chunk, rows) == rows[:2]  # 8 was refused: 5 was sampled in its place
    rows = [(7, None, None), (8, None, None), (9, None, None), (4, None, None)]
    assert verified_tokens(chunk, rows) == rows  # all accepted, and the token after them
    with pytest.raises(RuntimeError, match="needed"):
        verified_tokens(chunk, [(7, None, None), RuntimeError("needed")])
