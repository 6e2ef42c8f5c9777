"""What a block's KV depends on besides its tokens: the model, its numerics and the cache's
layout. Blocks of another fingerprint are never restored (the disk tier keeps each fingerprint's
files in a folder of their own, and every block's header repeats it)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import astuple, dataclass

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True)
class KVFingerprint:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str
    block_shape: tuple[int, ...]
    """One block's K (or V) tensor shape in one layer, as the attention backend lays it out."""
    numerics: str
    """The model's dtype, quantization and linear backend: each changes the KV's values."""
    weights: str
    """model_files_identity() of the checkpoint."""

    def digest(self) -> bytes:
        return hashlib.sha256(repr(astuple(self)).encode()).digest()


def model_files_identity(model_dir: str) -> str:
    """SHA-256 over config.json and the weight files' names, sizes and modification times: two
    checkpoints of one architecture and shape (a fine-tune) differ here. Cheap: no weight is read;
    a copy of the same files elsewhere (another mtime) only misses, never mixes."""
    h = hashlib.sha256()
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read())
    if os.path.isdir(model_dir):
        for name in sorted(os.listdir(model_dir)):
            if name.endswith(WEIGHT_SUFFIXES):
                st = os.stat(os.path.join(model_dir, name))
                h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()
