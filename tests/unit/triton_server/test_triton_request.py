"""Parsing of Triton request tensors (TensorRT-LLM names) and the instances' control board."""

import numpy as np
import pytest

from splitfuse.triton_server import control
from splitfuse.triton_server.control import Control
from splitfuse.inputs import InputError
from splitfuse.triton_server.request import parse_request


def t(value, dtype):
    return np.array([[value]], dtype=dtype)


BASE = {"text_input": t(b"hello", np.object_), "max_tokens": t(8, np.int32)}


def test_names_and_aliases_map_onto_sampling_params():
    p = parse_request({**BASE, "temperature": t(0.5, np.float32), "top_k": t(4, np.int32),
                       "min_length": t(2, np.int32), "random_seed": t(7, np.uint64),
                       "stop_words": np.array([[b"end", b""]], dtype=np.object_), "end_id": t(3, np.int32),
                       "stream": t(True, np.bool_), "return_log_probs": t(True, np.bool_)})
    assert p.prompt == "hello" and p.stream and p.exclude_input and p.return_log_probs
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.min_tokens, sp.seed) == (8, 0.5, 4, 2, 7)
    assert sp.stop == ["end"] and sp.stop_token_ids == [3] and sp.logprobs


def test_requests_without_temperature_get_the_configured_default():
    assert parse_request(BASE).params.greedy  # TensorRT-LLM's ensemble: greedy without sampling inputs
    assert parse_request(BASE, default_temperature=1.0).params.temperature == 1.0
    explicit = {**BASE, "temperature": t(0.7, np.float32)}
    assert parse_request(explicit, default_temperature=0.0).params.temperature == pytest.approx(0.7)


def test_min_tokens_above_max_tokens_names_both():
    for name in ("min_tokens", "min_length"):
        with pytest.raises(ValueError, match=r"min_tokens \(9\) must be <= max_tokens \(8\)"):
            parse_request({**BASE, name: t(9, np.int32)})


def test_input_ids_with_lengths():
    p = parse_request({"input_ids": np.array([[5, 6, 7, 0]], np.int32), "input_lengths": t(3, np.int32),
                       "max_tokens": t(4, np.int32)})
    assert p.prompt == [5, 6, 7]


@pytest.mark.parametrize("inputs,words", [
    ({"max_tokens": t(8, np.int32)}, "text_input"),
    ({"text_input": t(b"hi", np.object_)}, "max_tokens"),
    ({**BASE, "text_input": t(b"", np.object_)}, "empty"),
    ({**BASE, "text_input": t(b"\xff\xfe", np.object_)}, "UTF-8"),
    ({**BASE, "max_tokens": np.array([[1], [2]], np.int32)}, "batch size"),
    ({**BASE, "temperature": t(-1.0, np.float32)}, "temperature"),
    ({**BASE, "top_p": np.array([[0.5, 0.6]], np.float32)}, "top_p"),
])
def test_bad_inputs_raise_value_errors_naming_the_input(inputs, words):
    with pytest.raises(ValueError, match=words):
        parse_request(inputs)


def test_stop_request_needs_its_handle_not_a_prompt():
    parsed = parse_request({"stop": t(True, np.bool_), "stop_handle": np.array([[b"abc.123"]], np.object_)})
    assert parsed.stop_request and parsed.stop_handle == "abc.123"
    with pytest.raises(InputError, match="stop_handle"):
        parse_request({"stop": t(True, np.bool_)})  # a request id alone stops nothing
    with pytest.raises(InputError, match="stop_handle"):
        parse_request({"stop": t(True, np.bool_), "stop_handle": np.array([[b"x" * 500]], np.object_)})
    assert issubclass(InputError, ValueError)


def test_cache_salt_and_stop_handle_requests_are_parsed():
    parsed = parse_request({**BASE, "cache_salt": np.array([[b"tenant-1"]], np.object_),
                            "return_stop_handle": t(True, np.bool_)})
    assert parsed.params.cache_salt == "tenant-1" and parsed.return_stop_handle
    assert parse_request(BASE).params.cache_salt is None
    with pytest.raises(ValueError, match="cache_salt"):
        parse_request({**BASE, "cache_salt": np.array([[b""]], np.object_)})


def test_priority_is_parsed_defaults_to_0_and_is_bounded_naming_the_input():
    assert parse_request({**BASE, "priority": t(-1000, np.int32)}).params.priority == -1000
    assert parse_request({**BASE, "priority": t(1000, np.int32)}).params.priority == 1000
    assert parse_request(BASE).params.priority == 0
    for bad in (1001, -1001):
        with pytest.raises(ValueError, match=r"priority must be in \[-1000, 1000\], got " + str(bad)):
            parse_request({**BASE, "priority": t(bad, np.int32)})


def test_return_top_log_probs_sets_k_and_refuses_outside_0_to_20():
    parsed = parse_request({**BASE, "return_top_log_probs": t(5, np.int32)})
    assert parsed.return_top_log_probs == 5 and parsed.params.top_logprobs == 5
    assert not parsed.return_log_probs and not parsed.params.logprobs  # independent of return_log_probs
    assert parse_request({**BASE, "return_top_log_probs": t(20, np.int32)}).params.top_logprobs == 20
    assert parse_request({**BASE, "return_top_log_probs": t(0, np.int32)}).return_top_log_probs == 0
    assert parse_request(BASE).return_top_log_probs == 0 and parse_request(BASE).params.top_logprobs == 0
    for k in (21, -1):
        with pytest.raises(InputError, match=r"return_top_log_probs must be in \[0, 20\], got " + str(k)):
            parse_request({**BASE, "return_top_log_probs": t(k, np.int32)})


def test_control_board_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(control.ENV, str(tmp_path))
    a, b = Control("llm", "llm_0"), Control("llm", "llm_1")
    assert not a.draining() and control.num_idle(tmp_path) == 0
    control.request_drain(tmp_path)
    assert a.draining() and b.draining() and not a.aborting()
    a.set_idle(True)
    assert control.num_idle(tmp_path) == 1
    control.request_abort(tmp_path)
    assert b.aborting()
    # A stop lands on a; the generation lives in b: b takes it once, a takes nothing.
    a.post_stop(b.tag, Control.key("handle-1"))
    a.post_stop("0123456789ab", Control.key("handle-2"))  # no such instance: no file
    a.post_stop("../" + b.tag, Control.key("handle-3"))  # not a tag
    assert b.take_stops() == [Control.key("handle-1")]
    assert b.take_stops() == [] and a.take_stops() == []
    assert sorted(p.name for p in (tmp_path / "llm" / "stop").iterdir()) == sorted([a.tag, b.tag])


def test_the_fallback_control_folder_is_private(tmp_path):
    mine = control.private_dir(tmp_path / "board")
    assert (mine.stat().st_mode & 0o777) == 0o700 and control.private_dir(mine) == mine
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    with pytest.raises(RuntimeError, match="not a private directory"):
        control.private_dir(loose)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(RuntimeError, match="not a private directory"):
        control.private_dir(link)


def _b(value: str):
    return np.array([[value.encode()]], np.object_)


def test_lora_load_and_unload_requests_are_parsed_without_a_prompt():
    assert parse_request({"lora_load": _b("sql"), "lora_path": _b("sql-v1")}).lora_admin == ("load", "sql", "sql-v1")
    assert parse_request({"lora_unload": _b("sql")}).lora_admin == ("unload", "sql", None)
    assert parse_request(BASE).lora_admin is None
    with pytest.raises(InputError, match="lora_load needs lora_path"):
        parse_request({"lora_load": _b("sql")})
    with pytest.raises(InputError, match="lora_load and lora_unload"):
        parse_request({"lora_load": _b("a"), "lora_path": _b("a"), "lora_unload": _b("b")})
    with pytest.raises(InputError, match="lora_path is given without lora_load"):
        parse_request({**BASE, "lora_path": _b("a")})


def test_max_tokens_is_required_unless_embeddings_only():
    with pytest.raises(InputError, match="max_tokens"):
        parse_request({"text_input": t(b"hello", np.object_)})
    with pytest.raises(ValueError, match="embed cannot be combined with a guide"):
        parse_request({"text_input": t(b"hello", np.object_), "embeddings_only": t(True, np.bool_),
                       "guided_decoding_guide_type": t(b"json", np.object_)})
    assert not parse_request(BASE).embeddings_only
