"""IncrementalDetokenizer against the real byte-level BPE tokenizer of the demo model, and a
sentencepiece-style one (Llama 2's layout: ``▁`` for a space, byte fallback, a decoder that
strips a decode's leading space), built here.

Every test runs twice: with the byte-table fast path and with the tokenizer's decoder.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import splitfuse.engine.detokenizer as detokenizer_module
from splitfuse.tools.demo_model import build_sentencepiece_tokenizer, build_tokenizer
from splitfuse.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer, byte_level_table
from splitfuse.engine.sequence import SamplingParams

FFFD = "\ufffd"
CJK_EMOJI = "你好世界今天天气很好我们一起学习语言模型日本語のテキストを生成します한국어 문장도😀🚀🌍🔥✨🎉🤖📚🍣🐍"
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(autouse=True, params=["byte_table", "decoder"])
def decode_path(request, monkeypatch):
    if request.param == "decoder":
        monkeypatch.setattr(detokenizer_module, "byte_level_table", lambda tokenizer: None)
    return request.param


def run(tok, ids, chunks=None, prompt_ids=(), **params):
    """Feed `ids` in chunks (default one token per step), finishing on the last step."""
    detok = IncrementalDetokenizer(tok, SamplingParams(**params), prompt_ids)
    chunks = chunks or [1] * len(ids)
    deltas, matched, pos = [], False, 0
    for i, n in enumerate(chunks):
        step = detok.step(ids[pos : pos + n], finished=i == len(chunks) - 1)
        assert isinstance(step, DetokenizerStep)
        pos += n
        deltas.append(step.delta_text)
        matched = matched or step.stop_matched
        assert detok.text == "".join(deltas)
        if step.stop_matched:
            break
    return deltas, matched


def random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while n > 0:
        c = min(n, rng.choice([1, 1, 2, 3, 5, 8]))
        chunks.append(c)
        n -= c
    return chunks or [0]


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stop_reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the stop string that completes first (ties: earliest start)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


# -- byte exactness -------------------------------------------------------------------


def test_tokens_really_split_characters(tok):
    ids = encode(tok, CJK_EMOJI)
    assert any(FFFD in tok.decode([i]) for i in ids)  # otherwise the tests below prove little


@HYP
@given(ids=st.lists(st.integers(0, 511), max_size=40), seed=st.integers(0, 2**16), skip=st.booleans())
def test_random_ids_match_full_decode(tok, ids, seed, skip):
    expected = tok.decode(ids, skip_special_tokens=skip)
    one, _ = run(tok, ids, skip_special_tokens=skip)
    chunked, _ = run(tok, ids, random_chunks(random.Random(seed), len(ids)), skip_special_tokens=skip)
    assert "".join(one).encode() == expected.encode()
    assert "".join(chunked).encode() == expected.encode()


def test_long_runs_of_broken_bytes_match_full_decode(tok):
    # Byte tokens for continuation bytes / lone lead bytes, interleaved with specials.
    bytes_ids = [i for i in range(3, 512) if tok.decode([i]) == FFFD]
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.choice(bytes_ids + [0, 1, 2, 100]) for _ in range(rng.randint(5, 60))]
        for skip in (True, False):
            expected = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(run(tok, ids, skip_special_tokens=skip)[0]) == expected
            assert "".join(run(tok, ids, random_chunks(rng, len(ids)), skip_special_tokens=skip)[0]) == expected


text_strategy = st.lists(
    st.one_of(
        st.sampled_from(["hello", " world", " the", " token", "!", "\n", " ", "stop", "ab"]),
        st.text(alphabet=CJK_EMOJI, min_size=1, max_size=4),
        # Any character, but not "<" (could spell "<s>", a special token) or U+FFFD itself.
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="<" + FFFD),
                max_size=3),
    ),
    max_size=12,
).map("".join)


@HYP
@given(text=text_strategy, seed=st.integers(0, 2**16))
def test_valid_text_round_trips_without_replacement_chars(tok, text, seed):
    ids = encode(tok, text)
    expected = tok.decode(ids)
    assert expected == text
    for chunks in (None, random_chunks(random.Random(seed), len(ids))):
        deltas, matched = run(tok, ids, chunks)
        assert not matched
        assert "".join(deltas) == text
        assert not any(FFFD in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    ids = [1] + encode(tok, "hi 你好") + [2]
    assert "".join(run(tok, ids)[0]) == "hi 你好"
    assert "".join(run(tok, ids, skip_special_tokens=False)[0]) == "<s>hi 你好</s>"
    # A special token inside a multi-byte character: the skipped decode joins the bytes.
    split = encode(tok, "你")
    ids = split[:1] + [2] + split[1:]
    assert "".join(run(tok, ids)[0]) == tok.decode(ids, skip_special_tokens=True) == "你"


def test_kept_special_token_inside_a_character_hands_over_to_the_decoder(tok):
    # The fast path meets an added token while bytes of "你" are pending and must give the
    # rest to the decoder from its last exact cut.
    split = encode(tok, "ok 你好")
    at = next(i for i in range(1, len(split)) if FFFD in tok.decode(split[:i]))
    ids = split[:at] + [2] + split[at:] + encode(tok, " more 世界")
    expected = tok.decode(ids, skip_special_tokens=False)
    assert FFFD in expected
    for chunks in (None, [at, 1, len(ids) - at - 1], [at + 1, len(ids) - at - 1]):
        assert "".join(run(tok, ids, chunks, skip_special_tokens=False)[0]) == expected


def test_byte_table_built_for_byte_level_tokenizers(tok, tiny_llama, decode_path):
    if decode_path == "decoder":
        pytest.skip("the fast path is switched off in this mode")
    from transformers import AutoTokenizer

    for tokenizer in (tok, AutoTokenizer.from_pretrained(tiny_llama)):
        table = byte_level_table(tokenizer)
        assert table is not None and byte_level_table(tokenizer) is table  # built once
        assert table[1] is None and table[2] is None  # <s>, </s>: added tokens
        ids = encode(tokenizer, "héllo 你好 😀")
        assert b"".join(table[i] for i in ids) == "héllo 你好 😀".encode()


def test_abort_with_empty_final_step_flushes_held_bytes(tok):
    ids = encode(tok, "ok 你")
    assert len(ids) > 3
    partial = ids[:-1]  # the character's last byte token never arrives
    detok = IncrementalDetokenizer(tok, SamplingParams())
    deltas = [detok.step([t], finished=False).delta_text for t in partial]
    assert FFFD not in "".join(deltas)
    final = detok.step([], finished=True)
    assert detok.text == tok.decode(partial) and final.delta_text.endswith(FFFD)
    assert detok.step([5], finished=True).delta_text == ""  # nothing after the end


def test_window_stays_small(tok):
    text = ("the quick brown fox 你好世界 😀🚀 jumps " * 20).strip()
    ids = encode(tok, text)

    class Recording:  # forwards to the real tokenizer, recording window sizes
        def __init__(self, inner):
            self.inner, self.sizes = inner, []
            self.added_tokens_decoder = inner.added_tokens_decoder

        def decode(self, ids, **kw):
            self.sizes.append(len(ids))
            return self.inner.decode(ids, **kw)

    rec = Recording(tok)
    detok = IncrementalDetokenizer(rec, SamplingParams())
    for i, t in enumerate(ids):
        detok.step([t], finished=i == len(ids) - 1)
    assert detok.text == text
    assert len(ids) > 200 and max(rec.sizes) <= 8
    # One big step (one-shot) is decoded once; the window shrinks again afterwards.
    rec.sizes.clear()
    detok = IncrementalDetokenizer(rec, SamplingParams())
    detok.step(ids[:100], finished=False)
    rec.sizes.clear()
    for t in ids[100:150]:
        detok.step([t], finished=False)
    assert max(rec.sizes) <= 8


# -- stop strings -----------------------------------------------------------------------


def test_stop_string_in_the_middle(tok):
    ids = encode(tok, "hello world STOP and more text")
    deltas, matched = run(tok, ids, stop=["STOP"])
    assert matched and "".join(deltas) == "hello world "


def test_stop_string_spanning_tokens(tok):
    text = "the sea 你好世界 and the mountains"
    ids = encode(tok, text)
    stop = "好世界 a"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    deltas, matched = run(tok, ids, stop=[stop])
    assert matched and "".join(deltas) == "the sea 你"
    assert not any(FFFD in d for d in deltas)


def test_stop_string_at_the_very_end(tok):
    ids = encode(tok, "write a story.")
    deltas, matched = run(tok, ids, stop=["story."])
    assert matched and "".join(deltas) == "write a "


def test_multiple_stop_strings_first_to_complete_wins(tok):
    ids = encode(tok, "abcdef and more")
    # "bc" completes before "abcd", so the text ends before "bc" in every chunking.
    for chunks in (None, [len(ids)], [2] * (len(ids) // 2) + [1] * (len(ids) % 2)):
        deltas, matched = run(tok, ids, chunks, stop=["abcd", "bc", "more"])
        assert matched and "".join(deltas) == "a"
    deltas, matched = run(tok, ids, stop=["more", "def"])
    assert matched and "".join(deltas) == "abc"


def test_held_back_tail_is_flushed_at_finish(tok):
    ids = encode(tok, "hello world xy")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["xyz"]))
    for t in ids:
        step = detok.step([t], finished=False)
        assert not step.stop_matched
    assert detok.text == "hello world "  # last 2 chars (len("xyz") - 1) held back
    final = detok.step([], finished=True)
    assert final.delta_text == "xy" and not final.stop_matched
    assert detok.text == "hello world xy"


def test_stopped_detokenizer_emits_nothing_more(tok):
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["world"]))
    steps = [detok.step([t], finished=False) for t in encode(tok, "hello world again")]
    assert [s.stop_matched for s in steps].count(True) == 1
    assert detok.text == "hello "
    assert detok.step(encode(tok, " more"), finished=True) == DetokenizerStep("", False)


@HYP
@given(text=text_strategy, stops=st.lists(st.sampled_from(["stop", "o", "好世", "😀🚀", "\n\n", " the", "ab", "lo w"]),
                                         min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_stop_strings_streaming_equals_one_shot(tok, text, stops, seed):
    ids = encode(tok, text)
    expected_text, expected_match = stop_reference(tok.decode(ids), stops)
    results = [
        run(tok, ids, None, stop=stops),
        run(tok, ids, random_chunks(random.Random(seed), len(ids)), stop=stops),
        run(tok, ids, [len(ids)], stop=stops),
    ]
    for deltas, matched in results:
        assert "".join(deltas) == expected_text
        assert matched == expected_match
        assert not any(FFFD in d for d in deltas)


def test_saved_checkpoint_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = [1] + encode(tok, "hello 世界 🚀 done") + [2]
    deltas, matched = run(tok, ids, stop=["done"])
    assert matched and "".join(deltas) == "hello 世界 🚀 "
    assert "".join(run(tok, ids)[0]) == tok.decode(ids, skip_special_tokens=True)


# -- sentencepiece-style tokenizers: the first output token keeps its space --------------

SP_WORDS = ["hello", "world", "the", "sea", "你好", "ö", "€", "日本"]


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    tok = build_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"), vocab_size=512)
    assert byte_level_table(tok) is None  # the decoder path, whatever decode_path says
    return tok


def continuation(tok, prompt_ids, ids, skip=True):
    """The prompt's text continued: decode(prompt + output) minus decode(prompt)."""
    head = tok.decode(prompt_ids, skip_special_tokens=skip)
    full = tok.decode(list(prompt_ids) + list(ids), skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head):]


def test_sentencepiece_first_token_keeps_its_space(sp_tok):
    prompt, out = encode(sp_tok, "hello"), encode(sp_tok, "world sea")
    assert sp_tok.convert_ids_to_tokens(out) == ["\u2581world", "\u2581sea"]
    assert sp_tok.decode(out) == "world sea"  # what decoding the output alone gives
    assert "".join(run(sp_tok, out, prompt_ids=[1] + prompt)[0]) == " world sea"
    assert "".join(run(sp_tok, out, [2], prompt_ids=[1] + prompt)[0]) == " world sea"
    assert "".join(run(sp_tok, out)[0]) == "world sea"  # no prompt: nothing to continue


def test_sentencepiece_prompt_ending_mid_character_starts_afresh(sp_tok):
    euro = encode(sp_tok, "\u20acx")  # bytes of the euro sign, then x
    bytes_of_euro = [sp_tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
    assert euro[-4:-1] == bytes_of_euro
    prompt = encode(sp_tok, "the") + bytes_of_euro[:2]  # ends inside a character
    out = [bytes_of_euro[2]] + euro
    assert "".join(run(sp_tok, out, prompt_ids=prompt)[0]) == sp_tok.decode(out)


@HYP
@given(words=st.lists(st.sampled_from(SP_WORDS + [" ", "  ", "x", "ü", "😀"]), min_size=1, max_size=12),
       prompt_words=st.lists(st.sampled_from(SP_WORDS + ["ü", "😀", " "]), max_size=6), bos=st.booleans(),
       seed=st.integers(0, 2**16), skip=st.booleans())
def test_sentencepiece_text_continues_the_prompt(sp_tok, words, prompt_words, bos, seed, skip):
    prompt = ([1] if bos else []) + encode(sp_tok, " ".join(prompt_words))
    ids = encode(sp_tok, "".join(words))
    ids = ids[1:] if ids and len(ids) > 1 and seed % 3 == 0 else ids  # sometimes begin past the first piece
    expected = continuation(sp_tok, prompt, ids, skip)
    one, _ = run(sp_tok, ids, prompt_ids=prompt, skip_special_tokens=skip)
    chunked, _ = run(sp_tok, ids, random_chunks(random.Random(seed), len(ids)), prompt_ids=prompt,
                     skip_special_tokens=skip)
    assert "".join(one) == expected
    assert "".join(chunked) == expected


def test_byte_level_text_is_the_same_with_or_without_the_prompt(tok):
    prompt, out = encode(tok, "hello 世"), encode(tok, "界 🚀 done")
    assert "".join(run(tok, out, prompt_ids=prompt)[0]) == tok.decode(out) == continuation(tok, prompt, out)
