"""Oversized tensors are refused before they are converted (issue 55): a 64M-element input_ids
(256 MB over gRPC) and a 100 MB stop word get errors naming their limits, the llm model's stubs
do not grow past RSS_GROWTH_BOUND, and requests running alongside finish with the tokens they
get alone."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import served_greedy
from triton_helpers import grpc_generate

pytestmark = pytest.mark.serving

# Private (anonymous) memory: the stop word's one deserialised copy (as_numpy of a BYTES tensor,
# 100 MB, sometimes already returned to the OS) plus 64 MiB; converting the 64M ids to a Python
# list alone would take >= 512 MB, decoding the stop word 100 MB more. Measured: +0.2 to +95 MiB.
# The transport's shared memory (RssShmem: the 256 MB and 100 MB bodies) is Triton's, not counted.
STOP_WORD_BYTES = 100_000_000
RSS_GROWTH_BOUND = STOP_WORD_BYTES + 64 * 2**20
PROMPT = [1, 5, 9, 13, 17]


def _llm_stub_rss(work: str) -> int:
    """Anonymous resident bytes of the Python backend stubs serving the `llm` model of the server in `work`."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if not (cmd[0].startswith(work.encode()) and cmd[0].endswith(b"triton_python_backend_stub")
                    and any(b"/llm/" in c for c in cmd)):
                continue
            status = (entry / "status").read_text().splitlines()
            rss = next(ln for ln in status if ln.startswith("RssAnon:"))
            total += int(rss.split()[1]) * 1024
        except (OSError, StopIteration, IndexError):
            continue
    return total


def test_oversized_tensors_are_refused_before_conversion(served):
    alone = served_greedy(served.grpc_url, PROMPT, 24)
    assert alone.error is None
    work = str(Path(served.log_file).parent)
    before = _llm_stub_rss(work)
    assert before > 0, "no triton_python_backend_stub of the llm model found in /proc"

    neighbours: list = []

    def neighbour() -> None:
        for _ in range(3):
            neighbours.append(served_greedy(served.grpc_url, PROMPT, 24))

    threads = [threading.Thread(target=neighbour) for _ in range(2)]
    for th in threads:
        th.start()
    huge_ids = grpc_generate(served.grpc_url, "llm", {"input_ids": np.zeros((1, 64_000_000), dtype=np.int32),
                                                      "max_tokens": np.array([[4]], dtype=np.int32)})
    huge_word = np.array([[b"a" * STOP_WORD_BYTES]], dtype=np.object_)
    huge_stop = grpc_generate(served.grpc_url, "llm", {"text_input": "hello", "max_tokens": 4, "stop_words": huge_word})
    for th in threads:
        th.join(timeout=120)
    after = _llm_stub_rss(work)

    assert huge_ids.error is not None and "input_ids: 64000000 elements, the limit is" in huge_ids.error \
        and "(max_model_len)" in huge_ids.error, huge_ids.error
    assert huge_stop.error is not None and "stop_words: 100000000 bytes, the limit is" in huge_stop.error, \
        huge_stop.error
    print(f"llm stubs' anonymous RSS: {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after")
    assert after - before < RSS_GROWTH_BOUND, (before, after)
    assert len(neighbours) == 6
    for r in neighbours:
        assert r.error is None and r.output_ids == alone.output_ids


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_a_text_input_over_its_byte_bound_is_refused_naming_it(served, model):
    # 8 MB: past the bound of the tiny model (max_model_len x its longest token x 4 bytes) on both
    # the preprocessing model (ensemble) and the llm model; the server answers the next request.
    text = np.array([[b"a" * 8_000_000]], dtype=np.object_)
    r = grpc_generate(served.grpc_url, model, {"text_input": text, "max_tokens": 4})
    assert r.error is not None and "text_input: 8000000 bytes, the limit is" in r.error, r.error
    assert served_greedy(served.grpc_url, PROMPT, 4).error is None
