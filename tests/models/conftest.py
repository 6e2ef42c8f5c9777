"""Shared by the parity suites: the two CPU paths every greedy-parity test runs through."""

import pytest

from splitfuse.kernels.cpu import paged_attention as cpu_attention

CPU_PATHS = {
    "fast": dict(attention_backend="cpu", linear_backend="auto"),
    "fallback": dict(attention_backend="torch", linear_backend="torch"),
}


@pytest.fixture(params=list(CPU_PATHS))
def cpu_path(request):
    if request.param == "fast" and not cpu_attention.available():
        pytest.skip("C++ CPU kernels unavailable (no compiler?)")
    return CPU_PATHS[request.param]
