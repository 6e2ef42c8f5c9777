"""Bounds of SamplingParams that hold on every path (offline, Triton, OpenAI): a temperature too
small to divide by samples greedily, penalties in OpenAI's range, stop strings and stop ids
bounded in count and length, seeds within 64 bits; each refusal names its field."""

from __future__ import annotations

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.engine.sequence import MAX_STOP_LENGTH, MAX_STOP_STRINGS, MIN_TEMPERATURE


def test_a_vanishing_temperature_is_greedy(tiny_llama):
    assert SamplingParams(temperature=MIN_TEMPERATURE / 10).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    with LLM(tiny_llama, num_kv_blocks=64) as llm:
        prompts = [[1, 5, 9, 13], [1, 200, 300]]
        greedy = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        tiny = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1e-30, seed=3, ignore_eos=True))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.4e38}, "frequency_penalty"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["y" * (MAX_STOP_LENGTH + 1)]}, "stop"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
def test_out_of_range_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0, stop=["z" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS,
                   seed=2**64 - 1)
    SamplingParams(seed=-(2**63))


def test_a_text_the_context_cannot_hold_is_refused_before_tokenizing(tiny_llama, monkeypatch):
    with LLM(tiny_llama, num_kv_blocks=64) as llm:
        limit = llm.engine.validator.prompt_limit
        assert limit.context_tokens == llm.engine.max_model_len
        calls = []
        encode = llm.engine.tokenizer.encode
        monkeypatch.setattr(llm.engine.tokenizer, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
        with pytest.raises(ValueError, match="it was not tokenized"):
            llm.generate(["x" * (limit.max_chars + 1)], SamplingParams(max_tokens=2))
        assert calls == []
        # At the bound the text is tokenized (and then judged by its token count).
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(["x" * limit.max_chars], SamplingParams(max_tokens=2))
        assert calls == [limit.max_chars]
