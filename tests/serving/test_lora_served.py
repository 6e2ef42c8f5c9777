"""Multi-LoRA through the real server: two PEFT adapters (random non-zero B) over the tiny model,
picked per request with the `lora_name` input through `llm` (gRPC) and the ensemble (HTTP
generate). Each request's greedy tokens equal the in-process engine's for the same adapter, alone
and in one mixed concurrent batch; an unknown adapter is INVALID_ARG naming the served ones and
the next request is served; the metrics count requests per adapter and the resident adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import engine_kwargs, one_instance_server
from triton_helpers import grpc_generate, http_generate, metric_sum, settled

pytestmark = pytest.mark.serving

# Attention-only and MLP-only adapters of different ranks.
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "chat": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
NAMES = [None, *ADAPTERS]  # None: the base model
RUNTIME, RUNTIME_SPEC = "late", dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"])
PROMPT_IDS = [[1, 17, 33, 49], [1, 5, 9, 200, 31, 7, 77, 2, 150]]
TEXT = "the quick brown fox"
MAX_TOKENS = 10


def make_adapter(base: str, folder: Path, seed: int, **lora) -> str:
    """A PEFT folder for `base` with random A and B (peft's default B = 0 would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora)).save_pretrained(str(folder))
    return str(folder)


@dataclass
class LoraServer:
    model_dir: str
    adapters: dict[str, str]
    params: dict[str, str]
    server: object
    refs: dict[tuple[str | None, str], list[int]]
    """(adapter, prompt key) -> the in-process engine's greedy tokens."""


def _key(prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt))


@pytest.fixture(scope="module")
def lora_server(tiny_llama, tmp_path_factory):
    pytest.importorskip("peft", reason="peft is in the dev extra")
    from splitfuse.llm import LLM
    from splitfuse.engine.sequence import SamplingParams

    root = tmp_path_factory.mktemp("lora_served")
    adapters = {name: make_adapter(tiny_llama, root / name, seed, **spec)
                for seed, (name, spec) in enumerate(ADAPTERS.items(), start=7)}
    make_adapter(tiny_llama, root / RUNTIME, 11, **RUNTIME_SPEC)  # loaded at run time (lora_load_dir)
    # max_loras 3: the two configured and one loaded at run time.
    settings = {"lora_modules": ",".join(f"{n}={p}" for n, p in adapters.items()), "max_loras": "3",
                "max_lora_rank": "16", "lora_load_dir": str(root)}
    with one_instance_server(tiny_llama, settings, root / "server") as (params, server):
        prompts = [*PROMPT_IDS, TEXT]
        refs = {}
        with LLM(tiny_llama, **engine_kwargs(tiny_llama, params)) as llm:
            llm.engine.loras.load(llm.engine.loras.read(RUNTIME, RUNTIME))
            for name in [*NAMES, RUNTIME]:
                sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)
                for prompt, out in zip(prompts, llm.generate(prompts, sp)):
                    refs[(name, _key(prompt))] = out.token_ids
        for name in [*ADAPTERS, RUNTIME]:  # else equal outputs could not tell an adapter from the base
            assert all(refs[(name, _key(p))] != refs[(None, _key(p))] for p in prompts), name
        yield LoraServer(tiny_llama, adapters, params, server, refs)


def _llm_request(prompt_ids: list[int], name: str | None) -> dict:
    values = {"input_ids": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return values if name is None else {**values, "lora_name": name}


def _requests(s: LoraServer) -> dict[str, float]:
    return {name: metric_sum(s.server.metrics_url, "splitfuse_lora_requests_total", adapter=name) for name in ADAPTERS}


def test_each_adapter_and_the_base_give_the_engines_tokens_through_llm_and_ensemble(lora_server):
    s = lora_server
    before = settled(lambda: _requests(s))
    for name in NAMES:
        for prompt in PROMPT_IDS:
            r = grpc_generate(s.server.grpc_url, "llm", _llm_request(prompt, name))
            assert r.error is None, r.error
            assert r.output_ids == s.refs[(name, _key(prompt))], (name, prompt)
        body = {"text_input": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        whole = http_generate(s.server.http_url, "ensemble", body if name is None else {**body, "lora_name": name})
        assert "error" not in whole, whole
        assert whole["output_ids"] == s.refs[(name, TEXT)], name
    # Three requests per adapter (the base is no adapter's), on the one instance.
    after = settled(lambda: _requests(s))
    assert {n: after[n] - before[n] for n in ADAPTERS} == {n: 3 for n in ADAPTERS}


def test_a_mixed_concurrent_batch_gives_each_request_its_adapters_tokens(lora_server):
    s = lora_server
    jobs = [(prompt, name) for _ in range(2) for prompt in PROMPT_IDS for name in NAMES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: grpc_generate(s.server.grpc_url, "llm", _llm_request(*job)), jobs))
    for (prompt, name), r in zip(jobs, results):
        assert r.error is None, r.error
        assert r.output_ids == s.refs[(name, _key(prompt))], (name, prompt)


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_an_unknown_adapter_is_invalid_arg_naming_the_served_ones(lora_server, model):
    s = lora_server
    values = {"max_tokens": 4, "lora_name": "nope"}
    values.update({"input_ids": PROMPT_IDS[0]} if model == "llm" else {"text_input": TEXT})
    bad = grpc_generate(s.server.grpc_url, model, values)
    assert bad.error is not None and "unknown LoRA adapter 'nope'" in bad.error and "sql, chat" in bad.error
    whole = http_generate(s.server.http_url, model, {"text_input": TEXT, "max_tokens": 4, "lora_name": "nope"})
    assert whole.get("status") == 400 and "unknown LoRA adapter 'nope'" in whole["error"], whole  # INVALID_ARG
    empty = grpc_generate(s.server.grpc_url, model, {**values, "lora_name": ""})
    assert empty.error is not None and "lora_name is empty" in empty.error
    ok = grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], "sql"))
    assert ok.error is None and ok.output_ids == s.refs[("sql", _key(PROMPT_IDS[0]))]


def test_metrics_show_the_resident_adapters_and_their_loads(lora_server):
    s = lora_server
    url = s.server.metrics_url
    grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], "chat"))
    # max_loras=2: both adapters read at start and kept, none evicted.
    assert settled(lambda: metric_sum(url, "splitfuse_lora_adapters_resident")) == 2
    assert metric_sum(url, "splitfuse_lora_adapter_loads_total") == 2
    assert metric_sum(url, "splitfuse_lora_adapter_evictions_total") == 0
    assert metric_sum(url, "splitfuse_lora_requests_total", adapter="chat") >= 1


# ---- the OpenAI front: model=<adapter> ----------------------------------------------------------


@pytest.fixture(scope="module")
def lora_api(lora_server, tmp_path_factory):
    pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
    from openai_helpers import start_api, stop_api

    s = lora_server
    flags = [f for name, folder in s.adapters.items() for f in ("--lora", f"{name}={folder}")]
    api = start_api(s.model_dir, s.server.grpc_url, tmp_path_factory.mktemp("lora_api"), "api", *flags,
                    "--max-model-len", "2048", "--allow-runtime-lora")
    yield api
    stop_api(api)


def test_models_lists_the_adapters_after_the_base_with_their_parent(lora_api, lora_server):
    import openai

    client = lora_api.client()
    cards = [m.to_dict() for m in client.models.list().data]
    assert [c["id"] for c in cards] == [lora_api.model, *ADAPTERS]
    assert cards[0]["parent"] is None
    for card in cards[1:]:
        # The card names the adapter, never its folder on the server.
        assert card["parent"] == lora_api.model and card["root"] == card["id"]
        assert lora_server.adapters[card["id"]] not in json.dumps(card)
        assert card["max_model_len"] == 2048
    assert client.models.retrieve("sql").to_dict() == cards[1]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert "`sql`" in e.value.body["message"]


def test_an_adapters_completions_are_its_triton_tokens(lora_api, lora_server):
    import openai

    s, client = lora_server, lora_api.client()
    texts = {}
    for name in NAMES:
        answer = client.completions.create(model=name or lora_api.model, prompt=PROMPT_IDS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        triton = grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], name))
        assert triton.output_ids == s.refs[(name, _key(PROMPT_IDS[0]))]
        assert answer.model == (name or lora_api.model)
        assert answer.choices[0].text == triton.text.decode() and answer.usage.completion_tokens == MAX_TOKENS
        texts[name] = answer.choices[0].text
    assert len(set(texts.values())) == len(NAMES)  # each adapter answered, not the base
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "chat" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_the_openai_lora_example_asks_every_model(lora_api):
    example = Path(__file__).resolve().parents[2] / "client_examples" / "openai_lora.py"
    proc = subprocess.run([sys.executable, str(example), "--base-url", lora_api.base_url + "/v1", "--max-tokens", "4",
                           "hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{lora_api.model} (base)",
                                                      *(f"{n} (LoRA over {lora_api.model})" for n in ADAPTERS)]


# ---- loaded at run time: POST /v1/load_lora_adapter, /v1/unload_lora_adapter -------------------


def _post(api, path: str, body: dict) -> tuple[int, str]:
    """(status, body text) of a JSON POST to the front."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(api.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_adapter_loaded_through_the_front_serves_its_tokens_until_unloaded(lora_api, lora_server):
    import openai

    s, client = lora_server, lora_api.client()
    assert RUNTIME not in [m.id for m in client.models.list().data]
    assert _post(lora_api, "/v1/load_lora_adapter", {"lora_name": RUNTIME, "lora_path": RUNTIME}) == (
        200, f"Success: LoRA adapter '{RUNTIME}' loaded")
    assert [m.id for m in client.models.list().data][-1] == RUNTIME
    triton = grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], RUNTIME))
    assert triton.error is None and triton.output_ids == s.refs[(RUNTIME, _key(PROMPT_IDS[0]))]
    answer = client.completions.create(model=RUNTIME, prompt=PROMPT_IDS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == triton.text.decode()
    # Refusals leave it as it was: taken, one too many (max_loras=3), outside lora_load_dir, not an adapter.
    status, text = _post(lora_api, "/v1/load_lora_adapter", {"lora_name": RUNTIME, "lora_path": RUNTIME})
    assert status == 400 and f"'{RUNTIME}' is already loaded" in text
    status, text = _post(lora_api, "/v1/load_lora_adapter", {"lora_name": "more", "lora_path": "sql"})
    assert status == 400 and "max_loras=3" in text
    assert _post(lora_api, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 200  # room for the next two
    status, text = _post(lora_api, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})
    assert status == 400 and "lora_path" in text and "outside" in text
    status, text = _post(lora_api, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "."})
    assert status == 400 and "adapter_config.json" in text
    status, text = _post(lora_api, "/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": RUNTIME})
    assert status == 400 and "lora_name" in text
    assert _post(lora_api, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})[0] == 200
    assert _post(lora_api, "/v1/unload_lora_adapter", {"lora_name": RUNTIME}) == (
        200, f"Success: LoRA adapter '{RUNTIME}' unloaded")
    assert RUNTIME not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=RUNTIME, prompt="hi", max_tokens=2)
    gone = grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], RUNTIME))
    assert gone.error is not None and f"unknown LoRA adapter '{RUNTIME}'" in gone.error
    status, text = _post(lora_api, "/v1/unload_lora_adapter", {"lora_name": RUNTIME})
    assert status == 404 and f"unknown LoRA adapter '{RUNTIME}'" in text
    ok = grpc_generate(s.server.grpc_url, "llm", _llm_request(PROMPT_IDS[0], "sql"))  # reloaded: same tokens
    assert ok.error is None and ok.output_ids == s.refs[("sql", _key(PROMPT_IDS[0]))]


def test_run_time_lora_updating_is_refused_unless_the_front_allows_it(openai_front):
    status, text = _post(openai_front, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"})
    assert status == 403 and "--allow-runtime-lora" in text
    assert _post(openai_front, "/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 403
