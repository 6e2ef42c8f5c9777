"""The OpenAI-compatible front (`python -m splitfuse.openai_api`) against the real tritonserver,
driven with the official `openai` SDK: chat and completions, streamed == whole at temperature 0,
sampling parameters, error bodies, and a client that goes away frees its KV blocks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai_helpers import start_api, stop_api
from triton_helpers import abort_and_length_ends, metric_sum, settled, wait_for

from splitfuse.utils.ports import free_port

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

pytestmark = pytest.mark.serving

PROMPT = "the quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello world"}]


# The engine's limit for prompt + generation, as the launcher passes it: chat requests without
# max_tokens fill it. The test server's KV pool (4096 tokens, minus its watermark) could not hold
# one sequence of the checkpoint's full 4096 positions.
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def api(openai_front):
    """The session's shared front (conftest.py), started with --max-model-len MAX_MODEL_LEN."""
    return openai_front


def _used_blocks(served) -> float:
    return metric_sum(served.metrics_url, "splitfuse_kv_cache_blocks", state="used")


def _ended(served) -> tuple[float, float]:
    return abort_and_length_ends(served.metrics_url)


# ---- happy paths ----------------------------------------------------------------------------


def test_models_lists_the_served_model(api, served):
    models = api.client().models.list()
    assert [m.id for m in models.data] == [api.model]
    card = api.client().models.retrieve(api.model)
    assert card.id == api.model
    # The cards name the model, never a folder of the server.
    text = json.dumps([m.to_dict() for m in models.data] + [card.to_dict()])
    assert card.to_dict()["root"] == api.model and served.model_dir not in text and "/" not in text, text


def test_completion_greedy_matches_the_engine_and_streams_the_same_text(api, offline_llm):
    from splitfuse.engine.sequence import SamplingParams

    client = api.client()
    whole = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))[0]
    choice = whole.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(offline_llm.tokenizer(PROMPT).input_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.completions.create(model=api.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "expected one chunk per engine step"
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_with_token_ids_and_echo(api, offline_llm):
    ids = offline_llm.tokenizer(PROMPT).input_ids
    client = api.client()
    by_text = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=api.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_chat_uses_the_chat_template_and_streams_the_same_text(api, offline_llm):
    from splitfuse.engine.sequence import SamplingParams

    tok = offline_llm.tokenizer
    prompt_ids = tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids
    ref = offline_llm.generate([prompt_ids], SamplingParams(max_tokens=10, temperature=0.0))[0]
    client = api.client()
    whole = client.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=10, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.choices[0].finish_reason == ref.finish_reason

    stream = client.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == msg.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # max_completion_tokens is the chat API's newer name for max_tokens.
    newer = client.chat.completions.create(model=api.model, messages=MESSAGES, max_completion_tokens=10,
                                           temperature=0)
    assert newer.choices[0].message.content == msg.content


def test_chat_without_max_tokens_fills_the_context(api):
    # No max_tokens: up to max_model_len; stop early with a stop string found in a greedy run.
    client = api.client()
    ref = client.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=24, temperature=0)
    text = ref.choices[0].message.content
    stop = _stop_string(text)
    r = client.chat.completions.create(model=api.model, messages=MESSAGES, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]


def _stop_string(text: str) -> str:
    """A short piece from the middle of `text` (its first occurrence decides where text stops)."""
    for start in range(4, len(text) - 2):
        piece = text[start:start + 2]
        if piece.strip() and "\ufffd" not in piece:
            return piece
    pytest.skip(f"greedy text too short to cut: {text!r}")


def test_stop_strings_and_lengths(api):
    client = api.client()
    full = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0]
    stop = _stop_string(full.text)
    cut = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.text[:full.text.index(stop)]
    streamed = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    one = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"


def test_sampling_parameters_reach_the_engine(api, offline_llm):
    """Seeded sampling and penalties give what the engine gives for the same SamplingParams
    (a seeded request's tokens do not depend on what else shares the batch)."""
    from splitfuse.engine.sequence import SamplingParams

    client = api.client()
    kw = dict(model=api.model, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234))[0]
    assert a == ref.text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds all gave the same text"
    pen = dict(frequency_penalty=1.5, presence_penalty=0.5)
    penalised = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=24, temperature=0, **pen)
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, **pen))[0]
    assert penalised.choices[0].text == ref.text
    plain = offline_llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0]
    if len(set(plain.token_ids)) < len(plain.token_ids):  # penalties can only act on repeats
        assert ref.token_ids != plain.token_ids


def test_logprobs(api):
    client = api.client()
    r = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 8
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0.0 for c in content)
    streamed = client.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, stream=True)
    stream_lps = [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
                  for c in ch.choices[0].logprobs.content]
    assert stream_lps == pytest.approx([c.logprob for c in content], abs=1e-4)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=17), ["n", "16"]),
    (dict(top_p=0.0), ["top_p"]),
    (dict(temperature=-1.0), ["temperature"]),
    (dict(max_tokens=0), ["max_tokens"]),
    (dict(max_tokens=100_000), ["max_model_len"]),
    (dict(logprobs=6), ["logprobs"]),
    (dict(presence_penalty=5.0), ["presence_penalty"]),
    (dict(seed=-1), ["seed"]),
    (dict(stop=[""]), ["stop"]),
    (dict(best_of=2), ["best_of"]),
    (dict(extra_body={"unknown_knob": 1}), ["unknown_knob"]),
    (dict(stream_options={"include_usage": True}), ["stream_options"]),
    # Integers the engine's INT32 inputs cannot hold are refused, not wrapped (2**32 + 8 -> 8).
    (dict(max_tokens=2**32 + 8), ["max_tokens"]),
    (dict(extra_body={"top_k": 2**63}), ["top_k"]),
    (dict(extra_body={"min_tokens": 2**40}), ["min_tokens"]),
    (dict(seed=2**64), ["seed"]),
])
def test_completion_bad_parameters_are_400(api, kwargs, words):
    client = api.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=api.model, prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], err


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=17), ["n", "16"]),
    (dict(messages=[]), ["messages"]),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), ["role"]),
    (dict(top_logprobs=21, logprobs=True), ["top_logprobs"]),
    (dict(top_logprobs=2), ["top_logprobs", "logprobs: true"]),
    (dict(tools=[{"type": "function", "function": {"name": "not a name!"}}]), ["tools"]),
])
def test_chat_bad_parameters_are_400(api, kwargs, words):
    client = api.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=api.model, **{"messages": MESSAGES, "max_tokens": 4, **kwargs})
    for w in words:
        assert w in e.value.body["message"], e.value.body


def test_unknown_model_is_404_and_a_good_request_still_works(api):
    client = api.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # A request the engine itself refuses, streamed: still a 400, not a broken stream.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=api.model, prompt=PROMPT, max_tokens=100_000, stream=True)
    ok = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


@pytest.mark.parametrize("body", [b"{not json", b"[" * 100_000 + b"]" * 100_000,
                                  b'{"model": "m", "prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"])
def test_malformed_or_too_deep_json_is_400(api, body):
    status, answer = _status(api.base_url + "/v1/completions", body=None, raw=body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    # The front goes on answering.
    ok = api.client().completions.create(model=api.model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_chat_without_a_template_is_a_clear_400(served, tmp_path):
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    for f in Path(served.model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tok_dir / f.name)
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    assert not (tok_dir / "chat_template.jinja").exists()
    bare = start_api(served.model_dir, served.grpc_url, tmp_path, "bare", "--tokenizer", str(tok_dir))
    try:
        client = bare.client()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=bare.model, messages=MESSAGES, max_tokens=4)
        assert e.value.body["code"] == "no_chat_template" and "chat template" in e.value.body["message"]
        assert client.completions.create(model=bare.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        stop_api(bare)


# ---- disconnects ----------------------------------------------------------------------------

# ~0.85 s of the tiny model (~4,700 tokens/s here).
LONG = dict(max_tokens=4000, temperature=0, extra_body={"ignore_eos": True})


def test_streaming_client_that_disconnects_frees_its_kv_blocks(api, served):
    """The client leaves after its first chunk; the generation must end as aborted. An attempt
    whose generation had already run to its end before the disconnect could reach it (the
    streamed chunks can lag the engine by most of a second here) proves nothing and is retried."""
    assert wait_for(lambda: _used_blocks(served) == 0), "blocks still in use from an earlier test"
    client = api.client()
    outcomes = []
    for _ in range(3):
        aborted, completed = settled(lambda: _ended(served))  # once earlier ends are published
        stream = client.chat.completions.create(model=api.model, messages=MESSAGES, stream=True, **LONG)
        next(iter(stream))
        stream.close()  # drops the HTTP connection
        assert wait_for(lambda: sum(_ended(served)) == aborted + completed + 1), "the generation did not end"
        ended = _ended(served)
        assert wait_for(lambda: _used_blocks(served) == 0, timeout=10.0), "KV blocks not freed after disconnect"
        assert wait_for(lambda: metric_sum(served.metrics_url, "splitfuse_requests", state="running") == 0)
        outcomes.append((ended[0] - aborted, ended[1] - completed))
        if outcomes[-1] == (1, 0):
            return
    pytest.fail(f"the generation ran on after the client left, {len(outcomes)} times: {outcomes}")


# How soon a waiting client's generation must end once it left: the 1 s the front owes, plus
# the 0.5 s between the server's metric publications, plus 1 s for a loaded 2-core machine.
CANCEL_BOUND_S = 2.5


def _waiting_client_leaves(api, served, key: str | None = None) -> None:
    """A non-streamed request whose client leaves before its first token: the generation must end
    as aborted (not run to its length) and its KV blocks be freed, within CANCEL_BOUND_S."""
    assert wait_for(lambda: _used_blocks(served) == 0), "blocks still in use from an earlier test"
    aborted, completed = settled(lambda: _ended(served))
    host, port = api.base_url.removeprefix("http://").rsplit(":", 1)
    # The client leaves 0.2 s after sending, once the request is in the engine: not when the
    # KV-block gauge says so, as metrics are published every 0.5 s and the generation could end
    # before the API noticed the disconnect (it polls for one every 0.1 s).
    body = json.dumps({"model": api.model, "prompt": PROMPT, "max_tokens": LONG["max_tokens"], "temperature": 0,
                       "ignore_eos": True}).encode()
    auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + auth
                 + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.2)
    sock.close()
    left = time.monotonic()
    assert wait_for(lambda: _ended(served) != (aborted, completed), timeout=CANCEL_BOUND_S + 10)
    took = time.monotonic() - left
    assert _ended(served) == (aborted + 1, completed), \
        f"the generation ran on after the client left: {_ended(served)} against {(aborted, completed)}"
    assert wait_for(lambda: _used_blocks(served) == 0, timeout=2.0), "KV blocks not freed after disconnect"
    print(f"\n[disconnect] generation aborted {took:.2f}s after the client left (key: {bool(key)})")
    assert took < CANCEL_BOUND_S, f"the abort took {took:.2f}s"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, ok = _status(api.base_url + "/v1/completions", headers,
                         {"model": api.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert status == 200 and ok["usage"]["completion_tokens"] == 3


def test_waiting_client_that_disconnects_frees_its_kv_blocks(api, served):
    _waiting_client_leaves(api, served)


def test_with_an_api_key_a_waiting_client_that_disconnects_is_cancelled(keyed, served):
    """The key check must not hide the client's disconnect from the route (as Starlette's
    BaseHTTPMiddleware did: the generation then ran to its end)."""
    _waiting_client_leaves(keyed, served, key=keyed.key)


def test_launcher_entry_point_is_importable():
    from splitfuse.openai_api import ApiConfig, build_app, run  # noqa: F401

    cfg = ApiConfig(model_dir=os.getcwd(), triton_grpc_url="127.0.0.1:1", port=9000)
    assert cfg.served_model_name == Path(os.getcwd()).name
    with pytest.raises(ValueError, match="port"):
        ApiConfig(model_dir=".", port=0)


def _status(url: str, headers: dict[str, str] | None = None, body: dict | None = None,
            raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, headers={"Content-Type": "application/json", **(headers or {})}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


SERVED_NAME = "my-org/my-model"


@pytest.fixture(scope="module")
def keyed(served, tmp_path_factory):
    """A front that asks for an API key (`keyed.key`) and serves the model as SERVED_NAME."""
    key = "sk-test-" + os.urandom(8).hex()
    a = start_api(served.model_dir, served.grpc_url, tmp_path_factory.mktemp("openai-keyed"), "keyed",
                  "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", SERVED_NAME,
                  env={"SPLITFUSE_API_KEY": key})
    a.key, a.model = key, SERVED_NAME
    yield a
    stop_api(a)


def test_an_api_key_guards_every_route_but_health(keyed, served, tmp_path):
    key = keyed.key
    chat = {"model": keyed.model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                    {"Authorization": f"Bearer {key}x"}, {"Authorization": f"bearer {key}"}):
        # Every route, unknown paths too: a route mounted later is guarded without being listed.
        for path, body in (("/v1/models", None), ("/v1/chat/completions", chat),
                           ("/v1/chat/completions", {**chat, "stream": True}), ("/v2/models/llm", None),
                           ("/v1/embeddings", {"model": keyed.model, "input": "hello"}),
                           ("/anything", None)):
            status, answer = _status(keyed.base_url + path, headers, body)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, headers, answer)
    assert _status(keyed.base_url + "/health")[0] == 200
    assert _status(keyed.base_url + "/openapi.json")[0] == 200
    client = keyed.client(api_key=key)
    assert [m.id for m in client.models.list().data] == [keyed.model]
    whole = client.chat.completions.create(**chat)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert whole.choices[0].message.content == streamed
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").chat.completions.create(**chat)
    # An empty key would look protected and let everyone in: the front refuses to start.
    empty = tmp_path / "empty-key"
    empty.write_text("\n")
    run = subprocess.run([sys.executable, "-m", "splitfuse.openai_api", "--model", served.model_dir,
                          "--api-key-file", str(empty)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "is empty" in run.stderr, run.stderr[-2000:]


def test_a_served_model_name_is_the_only_name_listed_and_taken(keyed, served):
    client = keyed.client(api_key=keyed.key)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    card = client.models.retrieve(SERVED_NAME)  # its '/' goes through GET /v1/models/{name}
    assert card.id == card.root == SERVED_NAME
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.model == SERVED_NAME and r.usage.completion_tokens == 3
    # The name the checkpoint would give (the default without the flag) and any other: 404
    # naming the served name, as vLLM does.
    derived = Path(served.model_dir).resolve().name
    for name in (derived, "my-org", "my-org/my-model/x"):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=3)
        err = e.value.body
        assert err["code"] == "model_not_found" and f"`{SERVED_NAME}`" in err["message"], err
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=derived, prompt=PROMPT, max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(derived)


# ---- log-prob budget --------------------------------------------------------------------------


def test_a_request_over_the_logprob_budget_is_400_naming_the_limit(api):
    """Chat without max_tokens generates up to the rest of the context: with n=16 and
    top_logprobs=20 that is 16 x ~2,000 x 21 entries, over the default 200,000."""
    client = api.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=api.model, messages=MESSAGES, n=16, logprobs=True, top_logprobs=20)
    err = e.value.body
    assert err["param"] == "top_logprobs" and err["code"] == "logprobs_limit_exceeded", err
    assert "200000" in err["message"] and "--max-logprob-entries" in err["message"], err
    with pytest.raises(openai.BadRequestError, match="max-logprob-entries"):
        client.completions.create(model=api.model, prompt=PROMPT, n=16, logprobs=5, max_tokens=6000)
    # Within the budget: every choice gets its tokens' entries, each with its alternatives.
    r = client.chat.completions.create(model=api.model, messages=MESSAGES, n=2, max_tokens=6, logprobs=True,
                                       top_logprobs=5, temperature=0)
    assert len(r.choices) == 2
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 6 and all(len(c.top_logprobs) == 5 for c in content)


# ---- server faults are 503 --------------------------------------------------------------------


def test_a_server_fault_is_503_with_retry_after_and_a_bad_request_stays_400(api, served, tmp_path):
    """A front whose `llm` model is not loaded in the server (as after the model unloaded itself):
    Triton refuses with no status, a server fault, so the SDK gets a 503 (which it would retry),
    not a 400. A request the engine refuses (INVALID_ARGUMENT) stays a 400."""
    port = free_port()
    log = tmp_path / "unloaded.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "splitfuse.openai_api", "--model", served.model_dir,
                                 "--triton-grpc-url", served.grpc_url, "--triton-model", "llm_not_loaded",
                                 "--port", str(port), "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        # Up, but not ready: its /health asks for the model and answers 503.
        assert wait_for(lambda: _answers(base + "/health") == 503 or proc.poll() is not None, timeout=180), \
            log.read_text()[-2000:]
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = Path(served.model_dir).name
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=name, prompt=PROMPT, max_tokens=2, stream=stream)
            assert e.value.status_code == 503 and e.value.response.headers.get("retry-after") == "1"
            assert e.value.body["type"] == "server_error" and "llm_not_loaded" in e.value.body["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with pytest.raises(openai.BadRequestError) as bad:
        api.client().completions.create(model=api.model, prompt=PROMPT, max_tokens=100_000)
    assert bad.value.status_code == 400 and "max_model_len" in bad.value.body["message"]


def _answers(url: str) -> int:
    """The HTTP status `url` answers (0: none)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
