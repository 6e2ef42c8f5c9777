"""Greedy output must be token-identical to HF transformers generate(do_sample=False), fp32 CPU,
through both CPU paths: the fast one (C++ attention kernels + oneDNN linear layers) and the
fallback (torch attention + F.linear) that runs where no compiler is present."""

import json
import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams
from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine.loop import EngineLoop

PROMPT_LENGTHS = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 130]
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def _max_tokens(i: int) -> int:
    # Different lengths so sequences finish at different steps and the batch changes shape.
    return 6 + (i * 7) % 20


def _hf_reference(path: str, prompts: list[list[int]], max_tokens=_max_tokens) -> list[list[int]]:
    """HF greedy continuations; `max_tokens(i)` new tokens for prompt i."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens(i), do_sample=False)
            refs.append(out[0, len(p):].tolist())
    return refs


CASES = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "llama3-rope-tied": dict(arch="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "mixtral": dict(arch="mixtral"),  # sparse MoE MLP: 4 experts, top-2 (demo_model.ARCH_DEFAULTS)
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory):
    spec = dict(CASES[request.param])
    path = tiny_model_factory(spec.pop("arch"), **spec)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    prompts = _prompts(vocab)
    return request.param, path, prompts, _hf_reference(path, prompts)


def _run(path, prompts, backends, **config):
    llm = LLM(path, dtype="float32", **backends, **config)
    assert llm.engine.runner.attention_backend == backends["attention_backend"]
    params = [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_used_blocks == 0
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("token_budget", [7, 64, 512])
def test_splitfuse_greedy_matches_hf(case, cpu_path, token_budget, block_size):
    name, path, prompts, refs = case
    got, _ = _run(path, prompts, cpu_path, token_budget=token_budget, block_size=block_size)
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"{name} budget={token_budget} block={block_size} prompt#{i} (len {len(prompts[i])})"


@pytest.mark.parametrize("policy", ["prefill_first", "orca"])
def test_baseline_policies_match_hf(case, cpu_path, policy):
    name, path, prompts, refs = case
    got, _ = _run(path, prompts, cpu_path, token_budget=64, block_size=16, scheduler_policy=policy)
    assert got == refs, f"{name} {policy}"


def test_parity_under_preemption(case, cpu_path):
    """A KV pool far smaller than the load forces preemption and recomputation."""
    name, path, prompts, refs = case
    got, llm = _run(path, prompts, cpu_path, token_budget=32, block_size=4, num_kv_blocks=38, kv_watermark=0.0)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert got == refs, name


def test_deadline_order_under_preemption(case, cpu_path):
    """Prompts computed shortest deadline first (all arrive at once: the shortest first), in a pool
    that forces preemption: the same tokens."""
    name, path, prompts, refs = case
    got, llm = _run(path, prompts, cpu_path, token_budget=32, block_size=4, num_kv_blocks=38, kv_watermark=0.0,
                    prompt_order="deadline", first_token_deadline_tokens_per_s=100.0)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert got == refs, name


def test_bfloat16_runs(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", attention_backend="torch", token_budget=16)
    outs = llm.generate(_prompts(400)[:4], SamplingParams(max_tokens=5, temperature=0.0))
    assert all(len(o.token_ids) >= 1 and o.finished for o in outs)


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_streamed_through_engine_loop_matches_hf(case, cpu_path, stream_interval):
    """The serving path: EngineLoop's per-request mailboxes (outputs merged while a delivery is
    in flight) and stream_interval; the streamed deltas, joined, are HF's tokens."""
    name, path, prompts, refs = case
    loop = EngineLoop(EngineConfig(model=path, dtype="float32", token_budget=64, block_size=16, **cpu_path),
                      server=ServerConfig(stream_interval=stream_interval))
    loop.start()
    streams: dict[int, list] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def on_output(i):
        def collect(out):
            streams[i].append(out)
            if out.finished:
                done.release()
        return collect
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"r{i}", p, SamplingParams(max_tokens=_max_tokens(i), temperature=0.0), on_output(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        loop.shutdown(timeout=30)
    for i, ref in enumerate(refs):
        assert [t for o in streams[i] for t in o.delta_token_ids] == ref, f"{name} interval={stream_interval} #{i}"
