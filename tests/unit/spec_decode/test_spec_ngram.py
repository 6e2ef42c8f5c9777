"""The n-gram proposer's index against a brute-force search of the same rule."""

from hypothesis import given, settings
from hypothesis import strategies as st

from splitfuse.engine.sequence import SamplingParams, Sequence
from splitfuse.spec_decode.ngram import NgramIndex, NgramProposer


def brute_force(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The rule spelled out: longest suffix first, its latest earlier occurrence, what followed,
    copied on past the end as a text repeating itself would go on."""
    length = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        if length <= n:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[length:]
    return []


def test_longest_suffix_and_latest_occurrence_win():
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 4, 1, 2]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    # "1 2" last occurred at 5 (followed by 8 4); the 3-gram "4 1 2" never occurred before.
    assert index.propose(tokens, 3) == [8, 4, 1]
    tokens = tokens + [8]  # now "1 2 8" occurred at 5: its continuation
    index.extend(tokens)
    assert index.propose(tokens, 2) == [4, 1]
    assert NgramIndex(1, 2).propose([3, 4], 4) == []
    loop = [9, 3, 4, 3, 4]  # "3 4" repeating: proposed on with its period, not cut at the end
    index = NgramIndex(1, 3)
    index.extend(loop)
    assert index.propose(loop, 5) == [3, 4, 3, 4, 3]
    same = [5, 5, 5]
    index = NgramIndex(1, 4)
    index.extend(same)
    assert index.propose(same, 4) == [5, 5, 5, 5]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=4),
       sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)), k=st.integers(1, 6))
def test_incremental_index_matches_brute_force(tokens, cuts, sizes, k):
    ngram_min, extra = sizes
    ngram_max = ngram_min + extra
    index = NgramIndex(ngram_min, ngram_max)
    # Grown in arbitrary steps, as a sequence's tokens are (a prompt, then one or several at a time).
    for end in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        index.extend(tokens[:end])
        assert index.propose(tokens[:end], k) == brute_force(tokens[:end], ngram_min, ngram_max, k)


def test_proposer_tracks_each_sequence_and_respects_limits():
    proposer = NgramProposer(1, 2)
    a = Sequence("a", [5, 6, 7, 5, 6], SamplingParams(), arrival=0)
    b = Sequence("b", [1, 2, 3], SamplingParams(), arrival=1)
    assert proposer.propose([a, b], [4, 4]) == [[7, 5, 6, 7], []]
    a.append_token(7)
    assert proposer.propose([a], [1]) == [[5]]
    assert proposer.propose([a], [0]) == [[]]
    proposer.release(a)
    assert proposer.propose([a], [2]) == [[5, 6]]  # rebuilt from the tokens after a release
