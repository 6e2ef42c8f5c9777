"""LoRA deltas inside the one-call C++ decoder (splitfuse.kernels.cpu.decoder) against the Python
layers' (splitfuse.lora.batching: grouped and stacked products in torch): per step, the logits of
steps of few rows (decodes: XA over every slot's A) and of many rows (prompt chunks beside
decodes: XA over each row's own slot's columns, csrc/decoder.cpp's lora_shrink), the deltas
added by the linear kernel's epilogue (csrc/lora_simd.h), odd row counts, base rows between
adapter rows, adapters of rank 8, 16 and 64 (one slot's rows of B starting at an odd pair in bf16
when a rank is odd: rank 5), float32 and bfloat16; and a model whose projections' parts (q / k /
v, gate / up) start and end inside a vector and whose outputs end in a partial block (the
epilogue's column-by-column form)."""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="C++ CPU kernels not built")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, targets)
    "r8": (8, ALL), "r16": (16, ["q_proj", "v_proj", "down_proj"]), "r64": (64, ALL), "r5": (5, ["k_proj", "up_proj"]),
}
# Slots as wide as the largest rank per projection: 5 here, so a slot's columns start and end
# inside a vector (lora_shrink's partial stores) on every ISA.
NARROW = {"r5": (5, ALL), "r3": (3, ["q_proj", "o_proj", "up_proj"])}


def _adapter(base: str, folder, seed: int, rank: int, targets: list[str]) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                                                  init_lora_weights=False, lora_dropout=0.0))
    peft_model.save_pretrained(str(folder))
    return str(folder)


def _modules(base: str, root, adapters: dict) -> str:
    return ",".join(f"{name}={_adapter(base, root / name, i, rank, targets)}"
                    for i, (name, (rank, targets)) in enumerate(adapters.items()))


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama")
    return base, _modules(base, tmp_path_factory.mktemp("decoder_lora"), ADAPTERS)


@pytest.fixture(scope="module")
def served_misaligned(tiny_model_factory, tmp_path_factory):
    # head_dim 18: q [0, 72), k [72, 90), v [90, 108); intermediate 100: gate [0, 100), up [100, 200).
    base = tiny_model_factory("llama", hidden_size=72, intermediate_size=100)
    return base, _modules(base, tmp_path_factory.mktemp("decoder_lora_misaligned"), {"r8": (8, ALL), "r4": (4, ALL)})


@pytest.fixture(scope="module")
def served_narrow(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama")
    return base, _modules(base, tmp_path_factory.mktemp("decoder_lora_narrow"), NARROW)


def _run(base: str, modules: str, fused: bool, dtype: str,
         quantization: str = "none") -> tuple[LLM, list[torch.Tensor], list[list[int]], dict]:
    llm = LLM(base, dtype=dtype, lora_modules=modules, max_loras=4, max_lora_rank=64, fused_decoder=fused,
              linear_backend="cpu", attention_backend="cpu", token_budget=97, num_kv_blocks=256,
              quantization=quantization)
    runner = llm.engine.runner
    logits: list[torch.Tensor] = []
    launch, collect = runner.launch, runner.collect
    rows = {"few": 0, "many": 0}

    def launching(batch):
        if batch.lora is not None:
            rows["many" if batch.num_tokens > 64 else "few"] += 1
        return launch(batch)

    def recording():
        out = collect()
        logits.append(out.clone())
        return out

    runner.launch, runner.collect = launching, recording
    rng = random.Random(3)
    names = [None, *(name.split("=")[0] for name in modules.split(","))]
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 90))] for _ in range(15)]
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, lora_name=names[i % len(names)])
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return llm, logits, [o.token_ids for o in outs], rows


@pytest.mark.parametrize("adapters", ["served", "served_narrow", "served_misaligned"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "q4_0", "q8_0"])
def test_one_call_adds_the_python_layers_deltas(request, adapters, dtype):
    """int8: float32 activations over int8 projections, q4_0 / q8_0: over GGUF blocks (the
    misaligned model's projections cannot be blocked and keep the float kernel); their gate_up
    runs unfused (its kernel takes no addend before SwiGLU); the float kernels keep gate_up's fused
    SwiGLU with the deltas inside."""
    from splitfuse.layers.linear import CpuLinear, CpuQ4Linear

    base, modules = request.getfixturevalue(adapters)
    quantization = dtype if dtype in ("int8", "q4_0", "q8_0") else "none"
    if quantization == "int8":
        from splitfuse.layers.int8_linear import cpu_int8_supported

        if not cpu_int8_supported(torch.float32):
            pytest.skip("no C++ int8 kernel here")
    if quantization != "none":
        dtype = "float32"
    fused, fused_logits, fused_tokens, rows = _run(base, modules, True, dtype, quantization)
    plain, plain_logits, plain_tokens, _ = _run(base, modules, False, dtype, quantization)
    if fused.engine.runner.model.decoder_stack is None:
        pytest.skip(f"no fused decoder here: {fused.engine.runner.decoder_layers}")
    assert plain.engine.runner.model.decoder_stack is None
    gate_up = fused.engine.runner.model.model.layers[0].mlp.gate_up_proj.kernel
    assert gate_up.packed.gated == isinstance(gate_up, CpuLinear)
    assert isinstance(gate_up, CpuQ4Linear) == (quantization in ("q4_0", "q8_0") and adapters != "served_misaligned")
    assert rows["few"] > 0 and rows["many"] > 0, rows  # both of the C++ decoder's LoRA forms ran
    assert len(fused_logits) == len(plain_logits)
    # The same products in another grouping: float32 sums agree to rounding, bf16 to its rounding.
    atol = 1e-4 if dtype == "float32" else 0.05
    for step, (a, b) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0), \
            f"step {step}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    assert fused_tokens == plain_tokens


def test_a_row_slot_outside_the_stacks_is_refused(served):
    base, modules = served
    llm = LLM(base, dtype="float32", lora_modules=modules, max_loras=4, max_lora_rank=64, linear_backend="cpu",
              attention_backend="cpu", token_budget=97)
    model = llm.engine.runner.model
    if model.decoder_stack is None:
        pytest.skip(f"no fused decoder here: {llm.engine.runner.decoder_layers}")
    model._sync_stack_lora()
    stack, t = model.decoder_stack, 80  # more rows than the stacked form takes
    x = torch.zeros(t, stack.hidden)
    slots = torch.full((t,), 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="LoRA row slot"):
        stack.run(x, 1, torch.zeros(t, dtype=torch.int64), torch.zeros(8, stack.head_dim // 2),
                  torch.zeros(8, stack.head_dim // 2), torch.full((t,), -1, dtype=torch.int64),
                  torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                  torch.zeros(1, 1, dtype=torch.int32), lora_row_slot=slots)
