"""A GGUF file's tensor index and scalar metadata, read without the `gguf` package's reader.

`gguf.GGUFReader` turns every metadata value into numpy objects, the tokenizer's too: for Gemma
3's 262k-token vocabulary that held 0.67 GB and took 26 s on a loaded 2-core Zen 4, at every
start, for values the engine does not use at load (the tokenizer comes from the converted folder).
This reads the header once, skipping arrays by their lengths, and keeps the scalar values and,
per tensor, its name, type, dimensions and where its data starts. Little-endian files (what
llama.cpp writes) only; the format: magic "GGUF", version, tensor count, metadata count, the
key/value pairs, the tensor infos, then the data, aligned to `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types -> struct format of a scalar (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the index; `shape` as GGUF lists it (innermost first), as the reader's."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data_offset: int  # from the start of the file


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, kind: int) -> Any:
        """A scalar or string; an array is skipped (None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item)
        return None


def read_index(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(scalar metadata by key, tensors in file order) of the GGUF file at `path`; ValueError for
    a file that is not one (or is big-endian, or cut short)."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            c.pos = 4
            version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
            if not 1 <= version <= 0xFFFF:
                raise ValueError(f"GGUF version {version} (a big-endian file?)")
            fields = {}
            for _ in range(n_kv):
                key = c.string()
                fields[key] = c.value(c.take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.take("<Q") for _ in range(c.take("<I"))]
                infos.append((name, gguf.GGMLQuantizationType(c.take("<I")), dims, c.take("<Q")))
        except struct.error as e:
            raise ValueError(f"the header is cut short ({e})") from e
        alignment = int(fields.get("general.alignment") or _DEFAULT_ALIGNMENT)
        start = -(-c.pos // alignment) * alignment
        size = len(buf)
    tensors = [TensorInfo(name, kind, np.array(dims, dtype=np.uint64), start + offset)
               for name, kind, dims, offset in infos]
    for t in tensors:
        if t.data_offset + n_bytes(t) > size:
            raise ValueError(f"tensor {t.name!r} runs past the end of the file")
    return fields, tensors


def n_bytes(t: Any) -> int:
    """Bytes of a tensor's data."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    return int(np.prod([int(d) for d in t.shape])) // block * size
