"""Multi-LoRA greedy parity: one engine serving several PEFT adapters and the base, all in the
same batches, gives each request transformers + peft's greedy fp32 tokens for its adapter.

The adapters are made with peft on the tiny random models, with random (non-zero) B, different
ranks and targets: attention only (q, v, o: k's slice of the fused qkv untouched), the MLP only
(gate, up, down), all seven with rsLoRA scaling.
"""

import json
import logging
import random
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams
from test_parity import _hf_reference

ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=16, lora_alpha=8, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
PROMPT_LENGTHS = [1, 3, 8, 17, 33]


def make_adapter(base: str, out_dir, seed: int, **lora) -> str:
    """A PEFT folder for `base` with random A and B (peft's default B is zero: no effect)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora))
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def _max_tokens(i: int) -> int:
    return 5 + (i * 3) % 7


def _prompts(path: str, seed: int = 0) -> list[list[int]]:
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


class Setup:
    """A base model, its adapters and every (prompt, adapter) reference."""

    def __init__(self, base: str, adapters: dict[str, str]) -> None:
        self.base, self.adapters = base, adapters
        self.prompts = _prompts(base)
        self.refs = {None: _hf_reference(base, self.prompts, _max_tokens)}
        for name, folder in adapters.items():
            self.refs[name] = _hf_reference(folder, self.prompts, _max_tokens)
            assert self.refs[name] != self.refs[None], f"adapter {name} changes nothing: the test could not fail"

    @property
    def lora_modules(self) -> str:
        return ",".join(f"{name}={folder}" for name, folder in self.adapters.items())

    def mixed(self, names=None) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
        """Every prompt with every adapter and the base, interleaved: (prompts, params, refs)."""
        names = [None, *self.adapters] if names is None else names
        prompts, params, refs = [], [], []
        for i, p in enumerate(self.prompts):
            for name in names:
                prompts.append(p)
                params.append(SamplingParams(max_tokens=_max_tokens(i), temperature=0.0, lora_name=name))
                refs.append(self.refs[name][i])
        return prompts, params, refs


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def setup(request, tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory(request.param)
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    adapters = {name: make_adapter(base, root / name, seed, **spec)
                for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1)}
    return Setup(base, adapters)


def _generate(setup: Setup, prompts, params, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(setup.base, dtype="float32", lora_modules=setup.lora_modules, **config)
    outs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_used_blocks == 0
    return [o.token_ids for o in outs], llm


def _assert_refs(got, refs, params, what: str) -> None:
    for i, (g, r, p) in enumerate(zip(got, refs, params)):
        assert g == r, f"{what}: request #{i} lora={p.lora_name}"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("token_budget", [7, 64, 512])  # 512: prompt steps grouped, decodes stacked
def test_mixed_batch_matches_peft(setup, cpu_path, token_budget, block_size):
    prompts, params, refs = setup.mixed()
    got, llm = _generate(setup, prompts, params, token_budget=token_budget, block_size=block_size, **cpu_path)
    _assert_refs(got, refs, params, f"budget={token_budget} block={block_size}")
    stats = llm.engine.lora_stats()
    assert stats.requests == {name: len(setup.prompts) for name in setup.adapters}
    assert stats.loads == len(setup.adapters) and stats.evictions == 0


@pytest.mark.interpreter
def test_triton_lang_kernel_in_the_engine_matches_peft(setup):
    """The Triton-lang attention backend takes the Triton-lang LoRA kernel too (on CPU under the
    interpreter: a few prompts, every adapter and the base in one batch)."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests run the kernel natively")
    prompts, params, refs = setup.mixed()
    n = 2 * (len(setup.adapters) + 1)  # the first two prompts, with each adapter and the base
    got, llm = _generate(setup, prompts[:n], params[:n], attention_backend="triton", token_budget=24, block_size=4)
    assert llm.engine.runner.lora_state.device_kernel
    _assert_refs(got, refs[:n], params[:n], "triton-lang")


@pytest.mark.parametrize("token_budget", [16, 512])
def test_fused_cpu_decoder_with_adapters(setup, cpu_path, token_budget, caplog):
    """Adapters (gate/up included) keep the fused C++ decoder: it adds the deltas itself (its
    gate_up then unfused, the deltas going in before SwiGLU) in steps of any size, prompt chunks
    of several adapters beside decodes included. Base requests first, then mixed: every kind of
    step, each request its reference tokens."""
    prompts, params, refs = setup.mixed()
    llm = LLM(setup.base, dtype="float32", lora_modules=setup.lora_modules, token_budget=token_budget, **cpu_path)
    fast = cpu_path["attention_backend"] == "cpu"
    runs = {"lora": 0, "plain": 0}
    if fast:
        assert llm.engine.runner.decoder_layers == "one C++ call"
        stack = llm.engine.runner.model.decoder_stack
        run = stack.run

        def counted(*args, lora_row_slot=None, **kwargs):
            runs["plain" if lora_row_slot is None else "lora"] += 1
            return run(*args, lora_row_slot=lora_row_slot, **kwargs)

        stack.run = counted
    base_only = [i for i, p in enumerate(params) if p.lora_name is None]
    got_base = llm.generate([prompts[i] for i in base_only], [params[i] for i in base_only])
    assert [o.token_ids for o in got_base] == [refs[i] for i in base_only]
    with caplog.at_level(logging.INFO, logger="splitfuse.models.llama"):
        got = [o.token_ids for o in llm.generate(prompts, params)]
    _assert_refs(got, refs, params, "fused decoder")
    if fast:
        assert runs["plain"] > 0 and runs["lora"] > 0, runs
        assert not any("run the decoder layers in Python" in r.getMessage() for r in caplog.records)


def test_prefix_cache_keyed_by_adapter(setup):
    """The same long prompt under two adapters and the base, one after another with prefix
    caching on: no request reuses another adapter's KV, each gets its own tokens; the same
    adapter again reuses its own blocks."""
    rng = random.Random(7)
    prompt = [1] + [rng.randrange(3, 400) for _ in range(40)]
    names = [None, "attn", "all", "attn"]
    llm = LLM(setup.base, dtype="float32", lora_modules=setup.lora_modules, block_size=4, token_budget=64,
              enable_prefix_caching=True)
    refs = {name: _hf_reference(setup.adapters[name] if name else setup.base, [prompt], lambda i: 8)[0]
            for name in set(names)}
    for k, name in enumerate(names):
        out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, lora_name=name))[0]
        assert out.token_ids == refs[name], f"request {k} lora={name}"
        expected_hit = names.index(name) < k  # only a request of the same adapter earlier
        assert (out.num_cached_tokens > 0) == expected_hit, f"request {k} lora={name}: {out.num_cached_tokens}"
    llm.engine.check_invariants()


def test_preemption_with_adapters(setup):
    prompts, params, refs = setup.mixed()
    got, llm = _generate(setup, prompts, params, token_budget=32, block_size=4, num_kv_blocks=30, kv_watermark=0.0,
                         attention_backend="torch", linear_backend="torch")
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    _assert_refs(got, refs, params, "preemption")


def test_ngram_speculation_with_adapters(setup):
    """Proposed tokens are verified in rows carrying their sequence's adapter."""
    rng = random.Random(3)
    motif = [rng.randrange(3, 400) for _ in range(5)]
    prompts = [[1] + motif * 4, [1] + motif * 3 + motif[:2]]
    names = [None, "attn", "mlp", "all"]
    refs = {n: _hf_reference(setup.adapters[n] if n else setup.base, prompts, lambda i: 12) for n in names}
    llm = LLM(setup.base, dtype="float32", lora_modules=setup.lora_modules, token_budget=64,
              speculative_method="ngram", num_speculative_tokens=3)
    params = [SamplingParams(max_tokens=12, temperature=0.0, lora_name=n) for n in names for _ in prompts]
    outs = llm.generate([p for _ in names for p in prompts], params)
    want = [r for n in names for r in refs[n]]
    _assert_refs([o.token_ids for o in outs], want, params, "ngram")
    assert llm.engine.speculation.num_proposed > 0, "nothing was proposed: speculation was not exercised"


def test_lru_with_one_resident_adapter(setup):
    """max_loras=1 and two adapters requested alternately: each is evicted and read again when its
    turn comes, and every request still gets its reference tokens. (Submitted together, the second
    "attn" request would join the first while "mlp" waits: two batches of two.)"""
    names = ["attn", "mlp"]
    params = [SamplingParams(max_tokens=_max_tokens(1), temperature=0.0, lora_name=n) for n in names]
    prompts = [setup.prompts[1]] * len(names)
    got, llm = _generate(setup, prompts, params, max_loras=1, attention_backend="torch", linear_backend="torch")
    got += [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [setup.refs[n][1] for n in names * 2]
    stats = llm.engine.lora_stats()
    # The start reads "attn" (the first configured); then mlp, attn, mlp in turn.
    assert (stats.loads, stats.evictions, stats.resident) == (4, 3, ["mlp"])
    assert stats.requests == {"attn": 2, "mlp": 2, "all": 0}


def test_bfloat16_adapters_run_in_model_dtype(setup):
    prompts, params, _ = setup.mixed()
    llm = LLM(setup.base, dtype="bfloat16", lora_modules=setup.lora_modules, attention_backend="torch",
              token_budget=32)
    resident = llm.engine.runner.lora.acquire(["all"])[0]
    assert all(p.a.dtype is torch.bfloat16 for p in resident.projections.values())
    outs = llm.generate(prompts, params)
    assert all(o.finished and o.token_ids for o in outs)
    # The adapter is applied in bf16 too: its first tokens are not the base's.
    by_name = {}
    for o, p in zip(outs, params):
        by_name.setdefault(p.lora_name, []).append(o.token_ids[0])
    assert by_name["all"] != by_name[None]


def test_bfloat16_fused_decoder_adds_the_deltas_as_the_python_layers(setup):
    """bf16, steps of few rows: the C++ decoder's deltas (rounded to bf16 as torch's `+=`) give the
    Python layers' tokens exactly."""
    prompts, params, _ = setup.mixed()
    outs = {}
    for fused in (True, False):
        llm = LLM(setup.base, dtype="bfloat16", lora_modules=setup.lora_modules, attention_backend="cpu",
                  linear_backend="cpu", token_budget=16, fused_decoder=fused)
        if fused and llm.engine.runner.decoder_layers != "one C++ call":
            pytest.skip(f"no fused decoder here: {llm.engine.runner.decoder_layers}")
        outs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_rank_and_alpha_patterns(setup, tmp_path):
    """PEFT's per-module rank_pattern / alpha_pattern: each projection its own rank and scale."""
    folder = make_adapter(setup.base, tmp_path / "patterns", seed=9, r=4, lora_alpha=8,
                          target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
                          rank_pattern={"k_proj": 2, "layers.1.self_attn.o_proj": 8}, alpha_pattern={"down_proj": 32})
    refs = _hf_reference(folder, setup.prompts, _max_tokens)
    assert refs != setup.refs[None]
    llm = LLM(setup.base, dtype="float32", lora_modules=f"p={folder}", token_budget=16)
    params = [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0, lora_name="p")
              for i in range(len(setup.prompts))]
    assert [o.token_ids for o in llm.generate(setup.prompts, params)] == refs


def test_attention_adapter_on_mixture_of_experts(tiny_model_factory, tmp_path):
    """Mixtral: adapters on attention apply; MLP targets (its experts) are refused at load."""
    base = tiny_model_factory("mixtral")
    folder = make_adapter(base, tmp_path / "attn", seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    setup = Setup(base, {"attn": folder})
    prompts, params, refs = setup.mixed()
    got, _ = _generate(setup, prompts, params, token_budget=16)
    _assert_refs(got, refs, params, "mixtral")


def test_adapter_that_cannot_be_reloaded_fails_its_requests_only(setup, tmp_path):
    """An adapter evicted and then unreadable (its folder changed since the start) ends its own
    requests with an error naming the file; the others get their tokens."""
    gone = tmp_path / "gone"
    shutil.copytree(setup.adapters["mlp"], gone)
    llm = LLM(setup.base, dtype="float32", lora_modules=f"attn={setup.adapters['attn']},gone={gone}", max_loras=1,
              attention_backend="torch", linear_backend="torch")
    (gone / "adapter_model.safetensors").unlink()
    names = [None, "attn", "gone", "attn"]
    params = [SamplingParams(max_tokens=_max_tokens(2), temperature=0.0, lora_name=n) for n in names]
    outs = llm.generate([setup.prompts[2]] * len(names), params)
    assert outs[2].finish_reason == "error" and "adapter_model.safetensors not found" in outs[2].error
    for i in (0, 1, 3):
        assert outs[i].token_ids == setup.refs[names[i]][2], f"request {i} lora={names[i]}"
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_used_blocks == 0
