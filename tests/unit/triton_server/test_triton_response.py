"""Building the llm model's responses (TensorRT-LLM output names), without a server."""

import numpy as np

from splitfuse.engine.sequence import RequestOutput
from splitfuse.triton_server.request import parse_request
from splitfuse.triton_server.response import response_arrays, stop_ack_arrays


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


def top_output(finished: bool) -> RequestOutput:
    # output() with two alternatives per token: token 7 then token 8.
    seq_top = [[(7, -0.25), (3, -1.5)], [(8, -0.5), (9, -1.0)]]
    out = output(finished)
    out.delta_top_logprobs, out.seq_top_logprobs = seq_top[1:], seq_top
    return out


def parsed_top(k: int, **flags):
    return parse_request({"text_input": t(b"hi", np.object_), "max_tokens": t(4, np.int32),
                          "return_top_log_probs": t(k, np.int32), **{n: t(v, np.bool_) for n, v in flags.items()}})


def test_top_log_probs_are_shaped_one_by_tokens_by_k():
    streamed = response_arrays(parsed_top(2, stream=True), top_output(finished=False))
    assert streamed["top_log_probs"].dtype == np.float32 and streamed["top_log_prob_ids"].dtype == np.int32
    assert streamed["top_log_probs"].tolist() == [[[-0.5, -1.0]]]
    assert streamed["top_log_prob_ids"].tolist() == [[[8, 9]]]
    assert "log_probs" not in streamed
    whole = response_arrays(parsed_top(2, return_log_probs=True), top_output(finished=True))
    assert whole["top_log_probs"].tolist() == [[[-0.25, -1.5], [-0.5, -1.0]]]
    assert whole["top_log_prob_ids"].tolist() == [[[7, 3], [8, 9]]]
    assert whole["log_probs"].tolist() == [[-0.25, -0.5]]


def test_top_log_probs_describe_output_tokens_only_and_are_absent_without_k():
    echoed = response_arrays(parsed_top(2, stream=True), top_output(finished=False), echo_prompt="hi ")
    assert echoed["output_ids"].tolist() == [[1, 2, 8]] and echoed["top_log_prob_ids"].shape == (1, 1, 2)
    empty = top_output(finished=True)
    empty.delta_token_ids, empty.delta_top_logprobs = [], None  # e.g. the final output of an abort
    assert response_arrays(parsed_top(2, stream=True), empty)["top_log_probs"].shape == (1, 0, 2)
    for p in (parsed_top(0), parsed(return_log_probs=True)):
        a = response_arrays(p, top_output(finished=True))
        assert "top_log_probs" not in a and "top_log_prob_ids" not in a


def test_stop_ack():
    a = stop_ack_arrays()
    assert a["finish_reason"].tolist() == [[b"abort"]] and a["text_output"].tolist() == [[b""]]


def test_an_embedding_goes_out_as_embeddings_fp32_one_row():
    p = parse_request({"text_input": t(b"hi", np.object_), "embeddings_only": t(True, np.bool_)})
    assert p.embeddings_only and p.params.embed  # max_tokens is not needed for an embedding
    vector = np.array([0.6, 0.8, 0.0], np.float32)
    out = RequestOutput(request_id="r", prompt_token_ids=[1, 2], delta_token_ids=[], delta_text="", finished=True,
                        finish_reason="stop", seq_token_ids=[1, 2], num_tokens=2, embedding=vector)
    a = response_arrays(p, out)
    assert a["embeddings"].dtype == np.float32 and a["embeddings"].shape == (1, 3)
    np.testing.assert_array_equal(a["embeddings"][0], vector)
    assert "embeddings" not in response_arrays(parsed(), output(finished=True))
