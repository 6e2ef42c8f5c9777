"""Every request tensor is bounded before it is converted: input_ids by max_model_len, stop_words
by a count and a byte bound, text_input by the bytes the context can hold, every other input by
one value (and a byte bound for BYTES). The error names the input, its size and the limit."""

import numpy as np
import pytest

from splitfuse.engine.sequence import MAX_STOP_STRINGS
from splitfuse.inputs import InputError
from splitfuse.triton_server.request import (MAX_STOP_WORD_ENTRIES, MAX_STOP_WORDS_BYTES, InputBounds, check_bytes,
                                             check_shape, parse_request)

BOUNDS = InputBounds(max_model_len=64, max_text_bytes=1000)


def t(value, dtype):
    return np.array([[value]], dtype=dtype)


def _bounded_parse(request: dict):
    """As the llm model reads a request: every array's elements, then its bytes, then parsing."""
    for name, arr in request.items():
        check_shape(name, arr.shape, BOUNDS)
        check_bytes(name, arr, BOUNDS)
    return parse_request(request)


BASE = {"text_input": t(b"hello", np.object_), "max_tokens": t(8, np.int32)}


def test_input_ids_over_the_context_are_refused_naming_max_model_len():
    ids = np.zeros((1, 65), dtype=np.int32)
    with pytest.raises(InputError, match=r"^input_ids: 65 elements, the limit is 64 \(max_model_len\)$"):
        _bounded_parse({"input_ids": ids, "max_tokens": t(1, np.int32)})


def test_input_ids_at_the_context_pass():
    ids = np.ones((1, 64), dtype=np.int32)
    assert _bounded_parse({"input_ids": ids, "max_tokens": t(1, np.int32)}).prompt == [1] * 64


def test_too_many_stop_words_are_refused_naming_the_count():
    words = np.array([[b"x"] * (MAX_STOP_WORD_ENTRIES + 1)], dtype=np.object_)
    with pytest.raises(InputError, match=rf"^stop_words: {MAX_STOP_WORD_ENTRIES + 1} elements, the limit is "
                                         rf"{MAX_STOP_WORD_ENTRIES} \({MAX_STOP_STRINGS} stop strings"):
        _bounded_parse({**BASE, "stop_words": words})


def test_stop_words_over_the_byte_bound_are_refused_naming_it():
    words = np.array([[b"a" * (MAX_STOP_WORDS_BYTES + 1)]], dtype=np.object_)
    with pytest.raises(InputError, match=rf"^stop_words: {MAX_STOP_WORDS_BYTES + 1} bytes, the limit is "
                                         rf"{MAX_STOP_WORDS_BYTES} "):
        _bounded_parse({**BASE, "stop_words": words})


def test_a_text_input_over_the_byte_bound_is_refused():
    with pytest.raises(InputError, match=r"^text_input: 1001 bytes, the limit is 1000 "):
        _bounded_parse({**BASE, "text_input": t(b"a" * 1001, np.object_)})


def test_a_scalar_input_with_many_elements_is_refused_naming_it():
    with pytest.raises(InputError, match=r"^temperature: 2 elements, the limit is 1 \(one value per request\)$"):
        _bounded_parse({**BASE, "temperature": np.zeros((1, 2), dtype=np.float32)})


def test_a_bytes_name_over_its_bound_is_refused():
    with pytest.raises(InputError, match=r"^lora_name: 5000 bytes, the limit is 4096"):
        _bounded_parse({**BASE, "lora_name": t(b"a" * 5000, np.object_)})


def test_the_shape_alone_is_checked_before_any_array_exists():
    # What the served model checks on pb_utils.Tensor.shape(), before as_numpy().
    with pytest.raises(InputError, match=r"^input_ids: 64000000 elements, the limit is 64 \(max_model_len\)$"):
        check_shape("input_ids", [1, 64_000_000], BOUNDS)
    check_shape("input_ids", [1, 64], BOUNDS)


def test_a_normal_request_passes_the_bounds():
    p = _bounded_parse({**BASE, "stop_words": np.array([[b"end", b""]], dtype=np.object_)})
    assert p.prompt == "hello" and p.params.stop == ["end"]


def test_a_batch_of_two_is_named_as_a_batch_not_as_too_many_elements():
    with pytest.raises(InputError, match=r"^batch size must be 1 \(send \[\[\.\.\.\]\]\), got 2$"):
        check_shape("text_input", [2, 1], BOUNDS)
