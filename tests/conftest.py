"""Shared fixtures: tiny random-weight checkpoints built locally, once per session."""

import os

import torch

# Triton-lang kernels run on CPU tensors only under the interpreter, and the flag must be
# set before `triton` is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from splitfuse.demo_model import build_model  # noqa: E402


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
