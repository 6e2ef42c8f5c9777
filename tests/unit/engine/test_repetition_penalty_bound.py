"""repetition_penalty is bounded on both sides: (0, MAX_REPETITION_PENALTY], the error names the field and the range."""

import pytest

from splitfuse.engine.sequence import MAX_REPETITION_PENALTY, SamplingParams


@pytest.mark.parametrize("value", [0.0, -1.0, MAX_REPETITION_PENALTY + 0.01, 1e30, float("inf")])
def test_out_of_range_is_refused_naming_the_range(value):
    with pytest.raises(ValueError, match=r"repetition_penalty must be (in \(0, 2\.0\]|a finite number)"):
        SamplingParams(max_tokens=1, repetition_penalty=value)


@pytest.mark.parametrize("value", [0.01, 1.0, MAX_REPETITION_PENALTY])
def test_in_range_is_accepted(value):
    assert SamplingParams(max_tokens=1, repetition_penalty=value).repetition_penalty == value
