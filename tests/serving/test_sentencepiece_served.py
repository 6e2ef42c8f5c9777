"""A model with a tokenizer in Llama 2's layout (sentencepiece: `▁` word pieces, byte fallback, a
decoder that strips the leading space of what it decodes) served by a real tritonserver: the text
streamed through the ensemble and answered by the OpenAI endpoint continues the prompt's,
decode(prompt + output) minus decode(prompt), the first token's space included, and OpenAI's
log-prob tokens carry their spaces."""

from __future__ import annotations

import pytest
from conftest import engine_kwargs, one_instance_server
from openai_helpers import start_api, stop_api
from triton_helpers import grpc_generate

pytestmark = pytest.mark.serving

# A random model soon emits runs of byte tokens that are no UTF-8 (which the byte-fallback decoder
# replaces as a whole); these prompts' first two tokens are clear of them.
PROMPTS = ["hello world", "the sea", "tokens \U0001F600", "x"]
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def sp_model(tiny_model_factory):
    return tiny_model_factory("llama", tokenizer="sentencepiece")


@pytest.fixture(scope="module")
def sp_server(sp_model, tmp_path_factory):
    with one_instance_server(sp_model, {}, tmp_path_factory.mktemp("triton-sp")) as (params, server):
        yield params, server


@pytest.fixture(scope="module")
def expected(sp_model, sp_server):
    """Per prompt: the offline engine's greedy token ids and the continuation text they make."""
    from transformers import AutoTokenizer

    from splitfuse import LLM, SamplingParams

    params, _ = sp_server
    tok = AutoTokenizer.from_pretrained(sp_model)
    outs = LLM(sp_model, **engine_kwargs(sp_model, params)).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    want = []
    for out in outs:
        head = tok.decode(out.prompt_token_ids, skip_special_tokens=True)
        full = tok.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=True)
        assert full.startswith(head) and "\ufffd" not in full
        want.append((list(out.token_ids), full[len(head):]))
    # The case this is about: some answer begins with a piece that encodes a space.
    assert any(tok.convert_ids_to_tokens(ids[0]).startswith("\u2581") for ids, _ in want)
    return tok, want


def test_ensemble_text_continues_the_prompt(sp_server, expected):
    _, server = sp_server
    _, want = expected
    for prompt, (ids, text) in zip(PROMPTS, want):
        r = grpc_generate(server.grpc_url, "ensemble", {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                        "temperature": 0.0, "ignore_eos": True, "stream": True})
        assert r.error is None, r.error
        assert r.output_ids == ids and r.text.decode() == text, prompt


def test_openai_text_and_log_prob_tokens_keep_their_spaces(sp_model, sp_server, expected, tmp_path):
    _, server = sp_server
    tok, want = expected
    api = start_api(sp_model, server.grpc_url, tmp_path, "api")
    try:
        client = api.client()
        joined = 0
        for prompt, (ids, text) in zip(PROMPTS, want):
            out = client.completions.create(model=api.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            logprobs=1, extra_body={"ignore_eos": True})
            choice = out.choices[0]
            assert choice.text == text, prompt
            pieces = tok.convert_ids_to_tokens(ids)
            for piece, string in zip(pieces, choice.logprobs.tokens):  # the space a piece encodes
                assert string.startswith(" ") == piece.startswith("\u2581"), (prompt, piece, string)
            # Without a piece of a multi-byte character (each shows as U+FFFD alone), the tokens'
            # strings make the text.
            if not any(p.startswith("<0x") and int(p[3:5], 16) >= 0x80 for p in pieces):
                assert "".join(choice.logprobs.tokens) == text, prompt
                joined += 1
        assert joined >= 2
    finally:
        stop_api(api)
