"""Parse one Triton request (TensorRT-LLM ensemble tensor names) into a prompt and SamplingParams.

Pure numpy over a mapping of input name -> array, so it is tested without a server; the
`llm` model (llm_model.py) builds that mapping from the Triton request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitfuse.engine.sequence import (MAX_CACHE_SALT_LENGTH, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
                                       SamplingParams)
from splitfuse.errors import ERROR_CODE_PARAMETER
from splitfuse.inputs import InputError, PromptLimit
from splitfuse.structured.guide import MAX_GUIDE_LENGTH, Guide


# --------------------------------------------------------------------------- input bounds
# Checked before any tensor is converted (.tolist(), UTF-8 decoding): Triton bounds a body only
# by its transport limits, and converting first would cost ~9x the body in Python objects.

_UTF8_MAX = 4  # bytes per character
_MAX_NAME_BYTES = 4096  # a LoRA name, a guide type: short names
# stop_words travels as [1, N] with empty entries as padding (TensorRT-LLM clients): room for that.
MAX_STOP_WORD_ENTRIES = 2 * MAX_STOP_STRINGS
MAX_STOP_WORDS_BYTES = MAX_STOP_STRINGS * MAX_STOP_LENGTH * _UTF8_MAX


@dataclass(frozen=True)
class InputBounds:
    """The served model's limits that bound its request tensors."""

    max_model_len: int
    """input_ids holds at most this many elements (the model's context)."""
    max_text_bytes: int
    """text_input's UTF-8 bytes: the characters the context can hold with this tokenizer, 4 bytes each."""

    @classmethod
    def for_engine(cls, engine: Any) -> "InputBounds":
        return cls.for_prompt_limit(engine.validator.prompt_limit, engine.max_model_len)

    @classmethod
    def for_prompt_limit(cls, limit: PromptLimit, max_model_len: int) -> "InputBounds":
        return cls.for_prompt_chars(limit.max_chars, max_model_len)

    @classmethod
    def for_prompt_chars(cls, max_chars: int, max_model_len: int) -> "InputBounds":
        """For a text prompt of at most `max_chars` characters (PromptLimit.max_chars)."""
        return cls(max_model_len, max_chars * _UTF8_MAX)

    def elements(self, name: str) -> tuple[int, str]:
        """The most elements `name` may hold, and why."""
        if name == "input_ids":
            return self.max_model_len, "max_model_len"
        if name == "stop_words":
            return MAX_STOP_WORD_ENTRIES, f"{MAX_STOP_STRINGS} stop strings, padding included"
        return 1, "one value per request"

    def bytes(self, name: str) -> tuple[int, str]:
        """The most bytes a BYTES input `name` may hold in all, and why."""
        if name == "text_input":
            return self.max_text_bytes, "the characters the context can hold with this tokenizer"
        if name == "stop_words":
            return MAX_STOP_WORDS_BYTES, f"{MAX_STOP_STRINGS} stop strings of {MAX_STOP_LENGTH} characters"
        if name == "guided_decoding_guide":
            return MAX_GUIDE_LENGTH * _UTF8_MAX, f"{MAX_GUIDE_LENGTH} characters"
        if name == "cache_salt":
            return MAX_CACHE_SALT_LENGTH * _UTF8_MAX, f"{MAX_CACHE_SALT_LENGTH} characters"
        if name == "stop_handle":
            return MAX_STOP_HANDLE_LENGTH * _UTF8_MAX, f"{MAX_STOP_HANDLE_LENGTH} characters"
        return _MAX_NAME_BYTES, "a name"


def check_shape(name: str, shape: Any, bounds: InputBounds) -> None:
    """InputError when a tensor of `shape` holds more elements than `name` may (before it is read)."""
    if len(shape) > 1 and int(shape[0]) != 1:  # named as such, not as too many elements
        raise InputError(f"batch size must be 1 (send [[...]]), got {int(shape[0])}")
    count = 1
    for dim in shape:
        count *= int(dim)
    limit, why = bounds.elements(name)
    if count > limit:
        raise InputError(f"{name}: {count} elements, the limit is {limit} ({why})")


def check_bytes(name: str, arr: np.ndarray, bounds: InputBounds) -> None:
    """InputError when a BYTES tensor holds more bytes in all than `name` may (before decoding)."""
    if arr.dtype == object or arr.dtype.kind == "S":
        total = sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in arr.reshape(-1))
        limit, why = bounds.bytes(name)
        if total > limit:
            raise InputError(f"{name}: {total} bytes, the limit is {limit} ({why})")


def wants_error_code(parameters_json: str) -> bool:
    """Whether a request's parameters (Triton's JSON text) ask for ERROR_CODE_PARAMETER."""
    try:
        return json.loads(parameters_json or "{}").get(ERROR_CODE_PARAMETER) is True
    except (ValueError, AttributeError):
        return False


def input_arrays(tensors: Any, bounds: InputBounds) -> dict[str, np.ndarray]:
    """Triton input tensors -> name: array, each tensor's element count checked before as_numpy()
    (which deserialises a BYTES tensor into Python objects) and its bytes before anything decodes them."""
    arrays = {}
    for t in tensors:
        name = t.name()
        check_shape(name, t.shape(), bounds)
        arrays[name] = t.as_numpy()
        check_bytes(name, arrays[name], bounds)
    return arrays


# --------------------------------------------------------------------------- request parsing


def _tensor(request: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    return request.get(name)


def _scalar(request, name: str, kind: type) -> Any:
    arr = _tensor(request, name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InputError(f"{name} must hold one value per request (shape [1, 1]), got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    if kind is str:
        return _utf8(name, value)
    return kind(value)


def _utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{name} is not valid UTF-8: {e}") from None


def _first(request, names: tuple[str, ...], kind: type) -> Any:
    """The value of the first of several accepted names (e.g. min_tokens / min_length)."""
    for name in names:
        value = _scalar(request, name, kind)
        if value is not None:
            return value
    return None


# A stop handle is "<instance tag>.<random hex>" (see the llm model); anything longer is not one.
MAX_STOP_HANDLE_LENGTH = 128


@dataclass
class Parsed:
    stop_request: bool = False
    stop_handle: str = ""
    """Of a stop request: the handle the generation's first response carried."""
    prompt: str | list[int] = ""
    prompt_text: str | None = None
    params: SamplingParams | None = None
    stream: bool = False
    exclude_input: bool = True
    return_log_probs: bool = False
    return_top_log_probs: int = 0
    """k: each output token's k most likely tokens go out as top_log_probs / top_log_prob_ids."""
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    return_stop_handle: bool = False
    lora_admin: tuple[str, str, str | None] | None = None
    """Of a run-time LoRA request: ("load", name, folder) or ("unload", name, None)."""
    embeddings_only: bool = False
    """The prompt's embedding (output `embeddings`, FP32 [1, hidden]) instead of a generation."""


def _stop_request(request: Mapping[str, np.ndarray]) -> Parsed:
    """A request to stop the generation its stop_handle names."""
    handle = _scalar(request, "stop_handle", str)
    if not handle:
        raise InputError("a stop request needs the stop_handle of the generation to stop: ask for it with "
                         "return_stop_handle=true, its first response carries it (a request id alone no "
                         "longer stops a generation: ids are chosen by clients, so any client could stop "
                         "another's)")
    if len(handle) > MAX_STOP_HANDLE_LENGTH:
        raise InputError(f"stop_handle is longer than {MAX_STOP_HANDLE_LENGTH} characters: not a stop handle")
    return Parsed(stop_request=True, stop_handle=handle)


def _lora_admin(request: Mapping[str, np.ndarray]) -> tuple[str, str, str | None] | None:
    """A run-time LoRA load (lora_load = name, lora_path = its folder) or unload (lora_unload = name)."""
    load, unload = _scalar(request, "lora_load", str), _scalar(request, "lora_unload", str)
    if load is None and unload is None:
        if _tensor(request, "lora_path") is not None:
            raise InputError("lora_path is given without lora_load")
        return None
    if load is not None and unload is not None:
        raise InputError("lora_load and lora_unload: give one of them")
    if unload is not None:
        return ("unload", unload, None)
    path = _scalar(request, "lora_path", str)
    if not path:
        raise InputError("lora_load needs lora_path: the adapter's folder under the server's lora_load_dir")
    return ("load", load, path)


def _prompt(request: Mapping[str, np.ndarray], text: str | None) -> str | list[int]:
    """The prompt: input_ids (cut at input_lengths) if given, else text_input."""
    ids_arr = _tensor(request, "input_ids")
    if ids_arr is not None:
        ids = ids_arr.reshape(-1).tolist()
        length = _scalar(request, "input_lengths", int)
        if length is not None:
            if not 0 <= length <= len(ids):
                raise InputError(f"input_lengths ({length}) must be in [0, {len(ids)}]")
            ids = ids[:length]
        if not ids:
            raise InputError("input_ids is empty")
        return ids
    if text is not None:
        if not text:
            raise InputError("text_input is empty")
        return text
    raise InputError("text_input (or input_ids) is required")


def _sampling_kwargs(request: Mapping[str, np.ndarray], default_temperature: float) -> dict[str, Any]:
    """SamplingParams keywords from the request's sampling inputs."""
    embed = bool(_scalar(request, "embeddings_only", bool))
    max_tokens = _scalar(request, "max_tokens", int)
    if max_tokens is None and not embed:  # an embedding generates nothing: max_tokens plays no part
        raise InputError("max_tokens is required")
    kwargs: dict[str, Any] = {"max_tokens": 1 if max_tokens is None else max_tokens, "temperature": default_temperature,
                              "embed": embed}
    for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("repetition_penalty", float),
                       ("presence_penalty", float), ("frequency_penalty", float), ("ignore_eos", bool)):
        value = _scalar(request, name, kind)
        if value is not None:
            kwargs[name] = value
    min_tokens = _first(request, ("min_tokens", "min_length"), int)
    if min_tokens is not None:
        kwargs["min_tokens"] = min_tokens
    seed = _first(request, ("seed", "random_seed"), int)
    if seed is not None:
        kwargs["seed"] = seed
    words = _tensor(request, "stop_words")
    if words is not None:
        # Empty entries are padding in TensorRT-LLM-style clients, not stop strings.
        kwargs["stop"] = [w for w in (_utf8("stop_words", v) for v in words.reshape(-1)) if w]
    end_id = _scalar(request, "end_id", int)
    if end_id is not None and end_id >= 0:
        kwargs["stop_token_ids"] = [end_id]
    guide_type = _scalar(request, "guided_decoding_guide_type", str)
    if guide_type is not None:  # TensorRT-LLM's names; Guide names the problem with a bad one
        kwargs["guide"] = Guide(guide_type, _scalar(request, "guided_decoding_guide", str) or "")
    elif _tensor(request, "guided_decoding_guide") is not None:
        raise InputError("guided_decoding_guide needs guided_decoding_guide_type (json, json_schema, regex, "
                         "ebnf_grammar or choice)")
    salt = _scalar(request, "cache_salt", str)
    if salt is not None:
        kwargs["cache_salt"] = salt
    priority = _scalar(request, "priority", int)
    if priority is not None:  # SamplingParams names it when out of range
        kwargs["priority"] = priority
    lora = _scalar(request, "lora_name", str)
    if lora is not None:
        if not lora:  # checked here so that the error names the Triton input
            raise InputError("lora_name is empty: name a served LoRA adapter, or leave the input out for the base "
                             "model")
        kwargs["lora_name"] = lora
    return_log_probs = bool(_scalar(request, "return_log_probs", bool))
    kwargs["logprobs"] = return_log_probs
    top = _scalar(request, "return_top_log_probs", int)
    if top is not None:
        # Checked here, not only by SamplingParams, so that the error names the Triton input.
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InputError(f"return_top_log_probs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        kwargs["top_logprobs"] = top
    return kwargs


def parse_request(request: Mapping[str, np.ndarray], default_temperature: float = 0.0) -> Parsed:
    """Input tensors by name -> prompt + SamplingParams, raising InputError/ValueError.

    A request without `temperature` gets `default_temperature` (ServerConfig's; 0 = greedy).
    The arrays come bounded (input_arrays): nothing here converts an unbounded tensor."""
    batch = [a.shape[0] for a in (_tensor(request, n) for n in ("text_input", "input_ids", "max_tokens"))
             if a is not None and a.ndim > 0]
    bad = [b for b in batch if b != 1]
    if bad:
        raise InputError(f"batch size must be 1 (send [[...]]), got {bad[0]}")
    if _scalar(request, "stop", bool):
        return _stop_request(request)
    lora_admin = _lora_admin(request)
    if lora_admin is not None:
        return Parsed(lora_admin=lora_admin)

    text = _scalar(request, "text_input", str)
    prompt = _prompt(request, text)

    kwargs = _sampling_kwargs(request, default_temperature)
    return_log_probs = kwargs["logprobs"]
    params = SamplingParams(**kwargs)  # ValueError names the field

    exclude = _scalar(request, "exclude_input_in_output", bool)
    return Parsed(
        prompt=prompt,
        prompt_text=text,
        params=params,
        stream=bool(_scalar(request, "stream", bool)),
        exclude_input=True if exclude is None else exclude,
        return_log_probs=return_log_probs,
        return_top_log_probs=params.top_logprobs,
        return_num_input_tokens=bool(_scalar(request, "return_num_input_tokens", bool)),
        return_num_output_tokens=bool(_scalar(request, "return_num_output_tokens", bool)),
        return_num_cached_tokens=bool(_scalar(request, "return_num_cached_tokens", bool)),
        return_stop_handle=bool(_scalar(request, "return_stop_handle", bool)),
        embeddings_only=params.embed,
    )
