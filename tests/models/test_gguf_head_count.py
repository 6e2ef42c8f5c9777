"""A GGUF file whose attention head count does not split its q/k rows (metadata and tensors
disagree) fails through GGUFError when the tensor is read (models/gguf_tensors.py, for the float
load and for the blocks alike), naming the tensor and the metadata field, not with a bare reshape
error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

import torch  # noqa: E402

from splitfuse.models.gguf_tensors import GGUFError, GGUFTensors  # noqa: E402


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
    path = _write(tmp_path / "bad.gguf", rows=8)  # 8 rows are not 3 heads of 2k rows
    tensors = GGUFTensors(gguf.GGUFReader(path).tensors, path, "llama", 3, 3)
    for read in (lambda t: tensors.read(t, torch.float32), tensors.raw_rows):
        with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has 8 rows, which "
                                            r"llama\.attention\.head_count = 3 does not split"):
            read(tensors.by_name["blk.0.attn_q.weight"])


def test_head_count_that_splits_the_rows_converts(tmp_path):
    path = _write(tmp_path / "good.gguf", rows=6)
    tensors = GGUFTensors(gguf.GGUFReader(path).tensors, path, "llama", 3, 3)
    out = {name: tensors.read(t, torch.float32) for name, t in tensors}
    assert out["model.layers.0.self_attn.q_proj.weight"].shape == (6, 4)
