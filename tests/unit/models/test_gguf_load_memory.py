"""Loading a GGUF at about its file's size (models/gguf_loader.py): in a fresh process, a Q4_0
file of ~39 MB (random blocks, Llama-shaped: tests/gguf_files.py) starts under quantization=gguf
with every projection, the head and the embedding packed from the file's blocks (Q4_0 bytes
equal to the file's matrices, float32 only in the norms), and its resident memory grows by at
most the file's size, the KV pool and ALLOWANCE_BYTES while it loads. Had the float32 weights
(7.1x the file: ~275 MB) been allocated at full size at any point, the peak would pass that;
loading through the dequantized float32 checkpoint did."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from gguf_files import Q, write_random_gguf  # noqa: E402
from splitfuse.kernels.cpu import quant4  # noqa: E402

# Besides the weights and the KV pool: the engine's other buffers, the allocator's kept pages and
# one tensor's copies at a time (measured ~100 MB on a 2-core Zen 4; the float32 weights: ~275 MB).
ALLOWANCE_BYTES = 200 << 20

_CODE = """
import json, sys
import splitfuse.engine.llm_engine
from splitfuse import LLM
from splitfuse.kernels.cpu import quant4
from splitfuse.models.gguf_checkpoint import prepare_checkpoint
from splitfuse.utils.process_memory import peak_resident_bytes, resident_bytes

checkpoint = prepare_checkpoint(sys.argv[1])  # config and tokenizer, before the baseline
assert quant4.available()  # the kernels' library loaded before the baseline too
before = resident_bytes()
llm = LLM(checkpoint, quantization="gguf", num_kv_blocks=8, max_model_len=64, enable_prefix_caching=False)
peak = peak_resident_bytes()  # VmHWM: ru_maxrss would carry the test worker's size over
runner = llm.engine.runner
print(json.dumps({"before": before, "peak": peak, "weights": runner.model.weight_memory(),
                  "kv": runner.num_kv_blocks * runner.kv_bytes_per_block(),
                  "kernels": sorted({type(m.kernel).__name__ for m in runner.model.modules() if hasattr(m, "kernel")}),
                  "embedding_float": runner.model.model.embed_tokens.weight.numel()}))
llm.shutdown()
"""


@pytest.mark.skipif(not quant4.available(), reason="the C++ CPU kernels are not built")
def test_a_gguf_starts_at_about_its_file_size(tiny_llama, tmp_path):
    path = write_random_gguf(tiny_llama, tmp_path / "q4_0.gguf", layers=6, hidden=1024, intermediate=2816, heads=16,
                             kv_heads=4, quant=Q.Q4_0)
    size = path.stat().st_size
    run = subprocess.run([sys.executable, "-c", _CODE, str(path)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "SPLITFUSE_GGUF_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["kernels"] == ["CpuQ4Linear"], r["kernels"]
    assert r["embedding_float"] == 0  # looked up in the blocks
    matrices = r["weights"]["q4_0"]
    assert 0.97 * size < matrices <= size, (matrices, size)
    assert r["weights"]["float32"] < 100_000, r["weights"]  # the norms
    growth = r["peak"] - r["before"]
    print(f"file {size / 1e6:.1f} MB, KV {r['kv'] / 1e6:.1f} MB, peak growth {growth / 1e6:.1f} MB")
    # The loader's own line says the peak once the weights were packed (before the KV pool).
    loaded = [line for line in run.stderr.splitlines() if "process peak RSS" in line]
    assert growth <= size + r["kv"] + ALLOWANCE_BYTES, (growth, size, r["kv"], loaded)
