"""A GGUF file whose attention head count does not split its q/k rows (metadata and tensors
disagree) fails through GGUFError, naming the tensor and the metadata field, not with a bare
reshape error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from splitfuse.models.gguf_checkpoint import GGUFError, _tensors  # noqa: E402


def _write(path: Path, rows: int) -> Path:
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_head_count(3)
    w.add_head_count_kv(3)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((rows, 4), dtype=np.float32))
    w.add_tensor("blk.0.attn_k.weight", np.zeros((rows, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_head_count_that_does_not_split_the_rows_is_a_gguf_error(tmp_path):
    reader = gguf.GGUFReader(_write(tmp_path / "bad.gguf", rows=8))  # 8 rows are not 3 heads of 2k rows
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has 8 rows, which llama\.attention\.head_count "
                                        r"= 3 does not split"):
        _tensors(reader, "llama", 3, 3)


def test_head_count_that_splits_the_rows_converts(tmp_path):
    reader = gguf.GGUFReader(_write(tmp_path / "good.gguf", rows=6))
    out, _ = _tensors(reader, "llama", 3, 3)
    assert out["model.layers.0.self_attn.q_proj.weight"].shape == (6, 4)
