"""Sampler: greedy/top-k/top-p/temperature, seeds, min_tokens, penalties, logprobs."""

import math

import pytest
import torch

from splitfuse.engine.sampler import Sampler, SamplerOutput, derive_seed
from splitfuse.engine.sequence import SamplingParams, Sequence

V = 32
EOS = 2


def make_seq(prompt=(5, 6, 7), output=(), rid="r", **params) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(**params), arrival=0)
    for t in output:
        seq.append_token(t)
    return seq


def rand_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# -- greedy ---------------------------------------------------------------------------


def test_greedy_equals_argmax_and_ties_pick_lowest_index():
    logits = rand_logits(4)
    logits[3] = 0.0
    logits[3, [7, 3, 20]] = 5.0  # tie: lowest index wins, as torch.argmax / HF
    seqs = [make_seq(temperature=0.0) for _ in range(4)]
    out = Sampler([EOS])(logits, seqs)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 3
    assert out.logprobs == [None] * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype_and_logits_not_mutated(dtype):
    logits = rand_logits(3).to(dtype)
    before = logits.clone()
    seqs = [
        make_seq(temperature=0.0, repetition_penalty=1.5, output=(1, 2)),
        make_seq(temperature=0.7, top_k=5, top_p=0.9, presence_penalty=0.5, output=(4,), logprobs=True),
        make_seq(temperature=0.0, min_tokens=3),
    ]
    out = Sampler([EOS])(logits, seqs)
    assert torch.equal(logits, before)
    assert len(out.token_ids) == 3 and all(0 <= t < V for t in out.token_ids)
    assert out.logprobs[0] is None and isinstance(out.logprobs[1], float)


def test_empty_batch():
    out = Sampler([EOS])(torch.empty(0, V), [])
    assert out.token_ids == [] and out.logprobs == []


def test_top_k_one_equals_greedy():
    logits = rand_logits(16, seed=1)
    seqs = [make_seq(temperature=1.3, top_k=1, seed=i if i % 2 else None) for i in range(16)]
    for _ in range(3):
        assert Sampler([EOS])(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_picks_argmax():
    logits = rand_logits(16, seed=2)
    seqs = [make_seq(temperature=2.0, top_p=1e-6) for _ in range(16)]
    assert Sampler([EOS])(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows():
    logits = rand_logits(6, seed=3)
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = Sampler([EOS])(logits, seqs)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


# -- sampling distribution -------------------------------------------------------------


def _empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_samples_from_the_right_distribution(temperature):
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05] + [0.0] * 4)
    logits = probs.clamp_min(1e-12).log()
    n = 4000
    seqs = [make_seq(temperature=temperature) for _ in range(n)]
    tokens = Sampler([EOS], default_seed=7)(logits.expand(n, -1).contiguous(), seqs).token_ids
    expected = torch.softmax(logits / temperature, -1)
    got = _empirical(tokens, len(probs))
    # ~4.5 standard errors of a binomial proportion.
    tol = 4.5 * torch.sqrt(expected * (1 - expected) / n) + 1e-3
    assert torch.all((got - expected).abs() <= tol), (got, expected)
    assert set(tokens) <= {0, 1, 2, 3}


def test_top_k_and_top_p_sample_only_inside_the_kept_set():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(3000, -1).contiguous()
    k2 = Sampler([EOS])(logits, [make_seq(temperature=1.0, top_k=2) for _ in range(3000)]).token_ids
    assert set(k2) == {0, 1}
    assert abs(_empirical(k2, 4)[0].item() - 4 / 7) < 0.05
    # Mass before token 2 is 0.7 >= 0.65, so {0, 1} are kept; top_p 0.75 keeps {0, 1, 2}.
    p65 = Sampler([EOS])(logits, [make_seq(temperature=1.0, top_p=0.65) for _ in range(3000)]).token_ids
    assert set(p65) == {0, 1}
    p75 = Sampler([EOS])(logits, [make_seq(temperature=1.0, top_p=0.75) for _ in range(3000)]).token_ids
    assert set(p75) == {0, 1, 2}


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None]
    tokens = [Sampler([EOS])(logits, [make_seq(temperature=1.0, seed=s)]).token_ids[0] for s in range(1500)]
    got = _empirical(tokens, 3)
    assert torch.all((got - probs).abs() < 0.06), got


# -- seeds ----------------------------------------------------------------------------


def _seeded_run(sampler: Sampler, seed: int, row: torch.Tensor, steps: int, others: int, position: int, noise_seed: int):
    """Generate `steps` tokens for one seeded request inside a changing batch."""
    seq = make_seq(temperature=1.0, seed=seed, rid="seeded")
    g = torch.Generator().manual_seed(noise_seed)
    tokens = []
    for k in range(steps):
        batch = [make_seq(temperature=1.0, rid=f"o{j}", seed=(j + k if j % 2 else None)) for j in range(others)]
        batch.insert(position, seq)
        logits = torch.randn(len(batch), V, generator=g) * 3
        logits[position] = row
        tok = sampler(logits, batch).token_ids[position]
        tokens.append(tok)
        seq.append_token(tok)
    return tokens


def test_seeded_rows_ignore_batch_composition_position_and_history():
    row = torch.zeros(V)  # flat distribution: the draw is decided by the seed alone
    alone = _seeded_run(Sampler([EOS]), 1234, row, steps=12, others=0, position=0, noise_seed=0)
    crowded = _seeded_run(Sampler([EOS], default_seed=99), 1234, row, steps=12, others=5, position=3, noise_seed=1)
    assert alone == crowded
    # A sampler that already ran many unrelated steps gives the same tokens.
    warm = Sampler([EOS])
    _seeded_run(warm, 77, row, steps=5, others=3, position=1, noise_seed=2)
    assert _seeded_run(warm, 1234, row, steps=12, others=2, position=2, noise_seed=3) == alone
    # Different seeds differ somewhere.
    assert _seeded_run(Sampler([EOS]), 4321, row, steps=12, others=0, position=0, noise_seed=0) != alone


def test_seed_depends_on_output_index():
    row = torch.zeros(1, V)
    a = make_seq(temperature=1.0, seed=5)
    first = Sampler([EOS])(row, [a]).token_ids
    a.append_token(0)
    draws = set()
    for _ in range(10):
        draws.add(Sampler([EOS])(row, [a]).token_ids[0])
        a.append_token(0)
    assert len(draws) > 1
    assert Sampler([EOS])(row, [make_seq(temperature=1.0, seed=5)]).token_ids == first
    assert len({derive_seed(5, k) for k in range(100)}) == 100
    assert all(0 <= derive_seed(s, k) < 2**63 for s in (-3, 0, 2**70) for k in (0, 5))


def test_unseeded_rows_reproducible_from_default_seed():
    logits = torch.zeros(8, V)
    seqs = [make_seq(temperature=1.0) for _ in range(8)]
    assert Sampler([EOS], default_seed=3)(logits, seqs).token_ids == Sampler([EOS], default_seed=3)(logits, seqs).token_ids


# -- min_tokens -------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 4] = 8.0
    early = make_seq(temperature=0.0, min_tokens=2, stop_token_ids=[9], output=(11,))
    sampler = Sampler([EOS, 30])
    processed = sampler.process_logits(logits, [early])
    assert processed[0, [EOS, 9, 30]].tolist() == [-math.inf] * 3
    assert processed[0, 4].item() == 8.0
    assert sampler(logits, [early]).token_ids == [4]
    # Sampled rows never draw a masked id either.
    hot = [make_seq(temperature=5.0, min_tokens=1, stop_token_ids=[9]) for _ in range(200)]
    drawn = sampler(logits.expand(200, -1).contiguous(), hot).token_ids
    assert not {EOS, 9, 30} & set(drawn)
    # Once min_tokens outputs exist, nothing is masked.
    early.append_token(12)
    assert sampler(logits, [early]).token_ids == [EOS]


# -- penalties --------------------------------------------------------------------------


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0, 0.5]])
    seq = make_seq(prompt=(0, 1, 1), output=(3, 0), temperature=0.0, repetition_penalty=2.0)
    got = Sampler([EOS]).process_logits(logits, [seq])
    # Seen = {0, 1, 3}: positive divided, negative multiplied, once each however often seen.
    assert got.tolist() == [[1.0, -4.0, 3.0, -2.0, 4.0, 0.5]]


def test_presence_and_frequency_penalties_openai_semantics():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    # Prompt tokens do not count; output counts: token 1 x3, token 3 x1.
    seq = make_seq(prompt=(0, 2), output=(1, 3, 1, 1), temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = Sampler([EOS]).process_logits(logits, [seq])
    assert torch.allclose(got, torch.tensor([[1.0, 1.0 - 0.5 - 0.75, 1.0, 1.0 - 0.5 - 0.25, 1.0]]))


def test_penalties_compose_in_order_then_temperature_and_top_k():
    logits = torch.tensor([[4.0, -1.0, 2.0, 3.0, 0.0, 1.0], [4.0, -1.0, 2.0, 3.0, 0.0, 1.0]])
    seqs = [
        make_seq(prompt=(0,), output=(0, 1), temperature=2.0, repetition_penalty=2.0,
                 frequency_penalty=1.0, top_k=3, rid="a"),
        make_seq(prompt=(0,), output=(), temperature=1.0, rid="b"),  # untouched except temperature 1
    ]
    got = Sampler([EOS]).process_logits(logits, seqs)
    # Row a: rep -> [2, -2, 2, 3, 0, 1]; freq -> [1, -3, 2, 3, 0, 1]; /2 -> [.5, -1.5, 1, 1.5, 0, .5];
    # top-3 keeps 1.5, 1 and the tied 0.5s (ties at the threshold stay, as in HF).
    ninf = -math.inf
    assert got[0].tolist() == [0.5, ninf, 1.0, 1.5, ninf, 0.5]
    assert got[1].tolist() == logits[1].tolist()


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    seq = make_seq(prompt=(), output=(0,), temperature=0.0, repetition_penalty=2.0)
    assert Sampler([EOS])(logits, [seq]).token_ids == [1]
    seq = make_seq(prompt=(), output=(0, 0), temperature=0.0, frequency_penalty=0.6)
    assert Sampler([EOS])(logits, [seq]).token_ids == [1]


def test_top_p_processed_values():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    seq = make_seq(temperature=1.0, top_p=0.6)
    got = Sampler([EOS]).process_logits(probs.log()[None], [seq])[0]
    assert torch.isinf(got[[0, 2]]).all()
    assert torch.allclose(got[[1, 3]], probs.log()[[1, 3]])


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = rand_logits(4, seed=5)
    seqs = [
        make_seq(temperature=0.0, logprobs=True),
        make_seq(temperature=0.8, top_k=4, repetition_penalty=1.3, output=(1, 2, 3), logprobs=True, seed=1),
        make_seq(temperature=1.0),
        make_seq(temperature=0.0, presence_penalty=2.0, output=(int(logits[3].argmax()),), logprobs=True),
    ]
    out = Sampler([EOS])(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[2] is None
    # Greedy fast path with logprobs too.
    fast = Sampler([EOS])(logits, [make_seq(temperature=0.0, logprobs=True) for _ in range(4)])
    assert fast.logprobs == pytest.approx(ref.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1).tolist(), abs=1e-5)


# -- top logprobs -----------------------------------------------------------------------


def test_top_logprobs_are_the_log_softmax_topk_of_raw_logits_most_likely_first():
    logits = rand_logits(5, seed=6)
    seqs = [
        make_seq(temperature=0.0, top_logprobs=3),
        make_seq(temperature=0.9, top_k=4, repetition_penalty=1.4, output=(1, 2), top_logprobs=5, seed=2),
        make_seq(temperature=0.0, logprobs=True),
        make_seq(temperature=0.7, presence_penalty=1.5, output=(3,), logprobs=True, top_logprobs=20),
        make_seq(temperature=0.0),
    ]
    out = Sampler([EOS])(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    for i, k in ((0, 3), (1, 5), (3, 20)):
        values, ids = ref[i].topk(k)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)
        lps = [lp for _, lp in out.top_logprobs[i]]
        assert lps == sorted(lps, reverse=True)
    assert out.top_logprobs[2] is None and out.top_logprobs[4] is None
    # Asking for alternatives changes neither the tokens nor the chosen token's log-prob.
    plain = [make_seq(**{**vars(s.params), "top_logprobs": 0}, output=s.output_token_ids) for s in seqs]
    again = Sampler([EOS])(logits, plain)
    assert again.token_ids == out.token_ids
    assert again.logprobs == out.logprobs
    assert out.logprobs[3] == pytest.approx(ref[3, out.token_ids[3]].item(), abs=1e-5)
    # Greedy: the chosen token is the most likely one, with the same log-prob.
    assert out.top_logprobs[0][0][0] == out.token_ids[0]


def test_top_logprobs_on_the_greedy_fast_path_and_a_small_vocab():
    logits = rand_logits(3, seed=7, vocab=8)
    out = Sampler([EOS])(logits, [make_seq(temperature=0.0, top_logprobs=20, logprobs=True) for _ in range(3)])
    ref = torch.log_softmax(logits, -1)
    for i in range(3):
        assert len(out.top_logprobs[i]) == 8  # no more alternatives than tokens
        assert sorted(t for t, _ in out.top_logprobs[i]) == list(range(8))
        assert out.top_logprobs[i][0] == (out.token_ids[i], pytest.approx(out.logprobs[i], abs=1e-6))
        assert out.logprobs[i] == pytest.approx(ref[i].max().item(), abs=1e-5)


def test_masked_tokens_are_reported_with_minus_infinity():
    logits = rand_logits(1, seed=8)
    logits[0, 4:] = float("-inf")  # as a grammar's mask leaves a constrained row
    out = Sampler([EOS])(logits, [make_seq(temperature=0.0, top_logprobs=6)])
    lps = [lp for _, lp in out.top_logprobs[0]]
    assert all(math.isfinite(lp) for lp in lps[:4]) and lps[4:] == [float("-inf")] * 2
    assert {t for t, _ in out.top_logprobs[0][:4]} == {0, 1, 2, 3}


@pytest.mark.parametrize("k", [-1, 21, 1.5, True, "3"])
def test_top_logprobs_out_of_bounds_name_the_field(k):
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=k)


def test_top_logprobs_bounds_accepted():
    assert SamplingParams(top_logprobs=0).top_logprobs == 0
    assert SamplingParams(top_logprobs=20).top_logprobs == 20


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3),
                                    dict(temperature=0.9, seed=7), dict(temperature=1.5, seed=11, presence_penalty=0.5)])
def test_scores_masked_give_the_token_masking_first_gives(params):
    """A row's scores argmax to its token; the same scores with some tokens forbidden argmax to
    what the sampler picks when those tokens' logits are -inf before sampling (the race's noise is
    the seed's, and masking only removes competitors)."""
    for trial in range(20):
        logits = rand_logits(3, seed=trial)
        seqs = [make_seq(output=(1, 4), **params) for _ in range(3)]
        out = Sampler([EOS])(logits, seqs)
        assert out.scores.argmax(-1).tolist() == out.token_ids
        forbidden = torch.rand(3, V, generator=torch.Generator().manual_seed(100 + trial)) < 0.6
        forbidden[:, 0] = False  # something stays allowed
        masked_first = Sampler([EOS])(logits.masked_fill(forbidden, float("-inf")), seqs)
        assert out.scores.masked_fill(forbidden, float("-inf")).argmax(-1).tolist() == masked_first.token_ids
