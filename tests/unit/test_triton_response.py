"""Building the llm model's responses (TensorRT-LLM output names), without a server."""

import numpy as np

from splitfuse.sequence import RequestOutput
from splitfuse.triton.request import parse_request
from splitfuse.triton.response import response_arrays, stop_ack_arrays


def t(value, dtype):
    return np.array([[value]], dtype=dtype)


class Text:
    """The detokenizer's side of a RequestOutput: text that only grows."""

    def __init__(self, text: str) -> None:
        self.text = text


def output(finished: bool) -> RequestOutput:
    # Second step of a request: prompt [1, 2], tokens [7, 8] so far, text "héllo" so far.
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], delta_token_ids=[8], delta_text="llo",
                         finished=finished, finish_reason="length" if finished else None, delta_logprobs=[-0.5],
                         seq_token_ids=[1, 2, 7, 8], num_tokens=4, seq_logprobs=[-0.25, -0.5],
                         text_source=Text("héllo"), text_len=5)


def parsed(**flags):
    inputs = {"text_input": t(b"hi", np.object_), "max_tokens": t(4, np.int32)}
    inputs.update({k: t(v, np.bool_) for k, v in flags.items()})
    return parse_request(inputs)


def test_streaming_sends_the_delta():
    a = response_arrays(parsed(stream=True, return_log_probs=True), output(finished=False))
    assert a["text_output"].tolist() == [["llo".encode()]]
    assert a["output_ids"].tolist() == [[8]] and a["output_ids"].dtype == np.int32
    assert a["finish_reason"].tolist() == [[b""]]
    assert a["log_probs"].tolist() == [[-0.5]]
    assert "num_input_tokens" not in a and "num_output_tokens" not in a


def test_non_streaming_sends_everything_with_counts():
    a = response_arrays(parsed(return_num_input_tokens=True, return_num_output_tokens=True), output(finished=True))
    assert a["text_output"].tolist() == [["héllo".encode()]]
    assert a["output_ids"].tolist() == [[7, 8]] and a["finish_reason"].tolist() == [[b"length"]]
    assert a["num_input_tokens"].tolist() == [[2]] and a["num_output_tokens"].tolist() == [[2]]
    assert "log_probs" not in a


def test_echoed_prompt_leads_text_and_ids():
    a = response_arrays(parsed(stream=True), output(finished=False), echo_prompt="hi ")
    assert a["text_output"].tolist() == [[b"hi llo"]] and a["output_ids"].tolist() == [[1, 2, 8]]


def test_stop_ack():
    a = stop_ack_arrays()
    assert a["finish_reason"].tolist() == [[b"abort"]] and a["text_output"].tolist() == [[b""]]
