"""GGUF checkpoints (llama.cpp's single-file format) served as checkpoint directories.

`prepare_checkpoint(model)` takes what `EngineConfig.model` names: a checkpoint directory is
returned as it is; a `.gguf` file, or a directory holding one (and no config.json), is converted
once into a directory beside the others in the cache (`gguf_cache_dir()`) and that directory is
returned, so the engine, the Triton models and the OpenAI front all read one ordinary folder.
A later call with the same file (path, size and modification time) finds the conversion.

The conversion writes what is not weights: config.json and the tokenizer, from the file's
metadata through transformers' own GGUF readers (the same reference the tests compare against;
the chat template included), and last the marker naming the source file (`splitfuse_gguf.json`,
with the format's version: a folder of another version is converted again). Every tensor's name
and type are checked then (gguf_tensors.py), so a bad file fails before anything starts. The
weights stay in the file: the loader reads them from it one tensor at a time (gguf_loader.py),
each projection whose blocks the packed kernel multiplies (`PACKED_TYPES`, under quantization
"gguf" / "gguf-exact") straight into its packed weight (`GGUFSource.blocks`,
layers/q4_linear.py), every other tensor dequantized alone into the engine's dtype. The
config's `dtype` is the file's float type where every matrix is stored unquantized in it, else
float32 (dequantized values are exact in float32, not in bf16).

Dense Llama-family architectures (llama, mistral, qwen2, qwen3), Phi-3 / Phi-4-mini (phi3:
gguf_phi3.py), Gemma 3 (gemma3: gguf_gemma3.py) and Qwen3-MoE (qwen3moe, its experts through
gguf_moe.py) are taken; any other architecture, another mixture-of-experts file, a tensor type
`gguf` cannot dequantize, or a file that is not GGUF or is cut short raises GGUFError naming what
is wrong. Conversion time is logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from splitfuse.config import EngineConfig
from splitfuse.kernels.cpu import quant_parts
from splitfuse.kernels.cpu.gguf_blocks import KINDS as GGUF_BLOCK_KINDS
from splitfuse.models.gguf_gemma3 import configure_gemma3
from splitfuse.models.gguf_index import read_index
from splitfuse.models.gguf_moe import MOE_ARCHITECTURES, GGUFMoeError, configure_moe
from splitfuse.models.gguf_phi3 import ROPE_FACTOR_TENSORS, configure_phi3
from splitfuse.models.gguf_tensors import IGNORED, GGUFError, GGUFTensors, check_readable, hf_name
from splitfuse.utils.cache_dir import cache_dir as splitfuse_cache_dir

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
_CACHE_ENV = "SPLITFUSE_GGUF_CACHE"
_MARKER = "splitfuse_gguf.json"  # written last: a directory without it is not a finished conversion
# The converted folder's format: 2 holds no weights (1, unversioned, held them dequantized).
_FORMAT = 2
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def find_gguf(model: str | os.PathLike) -> Path | None:
    """The GGUF file `model` names (a .gguf file, or a directory holding exactly one and no
    config.json), else None."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): "
                            "name the one to serve")
        if files:
            return files[0].resolve()
    return None


def gguf_cache_dir() -> Path:
    root = os.environ.get(_CACHE_ENV)
    if root:
        return Path(root)
    return splitfuse_cache_dir("gguf")


def _source_key(gguf_file: Path) -> dict:
    st = gguf_file.stat()
    return {"source": str(gguf_file), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker(gguf_file: Path) -> dict:
    return {"format": _FORMAT, **_source_key(gguf_file)}


def is_converted(out_dir: Path, gguf_file: Path) -> bool:
    marker = out_dir / _MARKER
    try:
        return json.loads(marker.read_text()) == _marker(gguf_file)
    except (OSError, ValueError):
        return False


def with_checkpoint_dirs(config: EngineConfig) -> EngineConfig:
    """`config` with each GGUF file it names (model, tokenizer, draft model) replaced by its
    converted checkpoint directory (converted once, `prepare_checkpoint`)."""
    model = prepare_checkpoint(config.model)
    tokenizer = model if config.tokenizer == config.model else prepare_checkpoint(config.tokenizer)
    draft = config.speculative_model and prepare_checkpoint(config.speculative_model)
    if (model, tokenizer, draft) == (config.model, config.tokenizer, config.speculative_model):
        return config
    return dataclasses.replace(config, model=model, tokenizer=tokenizer, speculative_model=draft)


def prepare_checkpoint(model: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> str:
    """`model` as a checkpoint directory: unchanged when it is one, else its GGUF file converted
    (once) into `out_dir` (default: a directory in gguf_cache_dir() named after the file)."""
    gguf_file = find_gguf(model)
    if gguf_file is None:
        return os.fspath(model)
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(_source_key(gguf_file), sort_keys=True).encode()).hexdigest()[:12]
        out_dir = gguf_cache_dir() / f"{gguf_file.stem}-{digest}"
    out = Path(out_dir)
    if not is_converted(out, gguf_file):
        convert(gguf_file, out)
    return str(out)


def _reader(gguf_file: Path):
    """A GGUF reader over the file (memory-mapped: tensor data is read when touched)."""
    try:
        import gguf
    except ImportError as e:
        raise GGUFError("reading a GGUF checkpoint needs the `gguf` package (pip install gguf)") from e
    try:
        return gguf.GGUFReader(gguf_file)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad files
        raise GGUFError(f"{gguf_file} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, name: str):
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _check_tensors(reader, arch: str) -> set[str]:
    """Raise GGUFError for a tensor this engine does not load; the types of the others."""
    types: set[str] = set()
    for t in reader.tensors:
        if t.name in IGNORED:
            continue
        if hf_name(t.name, arch) is None:
            what = "mixture-of-experts tensors" if "_exps" in t.name or "ffn_gate_inp" in t.name else "a tensor"
            raise GGUFError(f"{arch} GGUF with {what} this engine does not load: {t.name!r}")
        try:
            check_readable(t)
        except GGUFError:
            raise
        except (ValueError, IndexError, RuntimeError) as e:  # a short data region
            raise GGUFError(f"tensor {t.name!r} ({t.tensor_type.name}) could not be read: {e}") from e
        types.add(t.tensor_type.name)
    return types


def _checkpoint_dtype(reader) -> str:
    """The float type all matrices share when none is quantized, else float32."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2 and t.name not in IGNORED}
    return _FLOAT_DTYPES.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"


def _qwen3_head_dim(reader, file_name: str, config, arch: str = "qwen3") -> int:
    """Qwen3's (and qwen3moe's) head size from `{arch}.attention.key_length` (llama.cpp's default
    where absent: hidden / heads). transformers' GGUF reader leaves it at Qwen3Config's default
    (128), which is wrong for any other model."""
    key = _field(reader, f"{arch}.attention.key_length")
    head_dim = int(key) if key is not None else config.hidden_size // config.num_attention_heads
    value = _field(reader, f"{arch}.attention.value_length")
    if value is not None and int(value) != head_dim:
        raise GGUFError(f"{file_name}: {arch}.attention.value_length = {value} differs from the key length "
                        f"{head_dim}: not supported")
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise GGUFError(f"{file_name}: {arch}.rope.dimension_count = {rotary} (rotary on part of each head) "
                        f"differs from the head size {head_dim}: not supported")
    return head_dim


def _configure_moe(reader, arch: str, config, file_name: str) -> None:
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith(".ffn_gate_exps.weight")}
    try:
        configure_moe(lambda key: _field(reader, key), arch, config, file_name, config.num_hidden_layers, sparse)
    except GGUFMoeError as e:
        raise GGUFError(str(e)) from e


def _configure(reader, arch: str, config, file_name: str) -> None:
    """What transformers' GGUF config reader leaves out or gets wrong, per architecture."""
    if arch in ("qwen3", "qwen3moe"):
        config.head_dim = _qwen3_head_dim(reader, file_name, config, arch)
    if arch in MOE_ARCHITECTURES:
        _configure_moe(reader, arch, config, file_name)
    try:
        if arch == "gemma3":
            configure_gemma3(lambda key: _field(reader, key), config, file_name)
        if arch == "phi3":
            factors = {t.name: t.data for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
            configure_phi3(lambda key: _field(reader, key), factors, config, file_name)
    except ValueError as e:
        raise GGUFError(str(e)) from e


def _hf_config(reader, gguf_file: Path):
    """(the model's config as config.json holds it, its tokenizer, the tensor types)."""
    from transformers import AutoConfig, AutoTokenizer

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{gguf_file.name}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if _field(reader, f"{arch}.expert_count") and arch not in MOE_ARCHITECTURES:
        raise GGUFError(f"{gguf_file.name}: a mixture-of-experts {arch} GGUF is not supported (dense models only)")
    try:
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as e:
        raise GGUFError(f"{gguf_file.name}: its metadata gives no usable config or tokenizer "
                        f"({type(e).__name__}: {e})") from e
    _configure(reader, arch, config, gguf_file.name)
    types = _check_tensors(reader, arch)
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = _checkpoint_dtype(reader)
    # Gemma3TextConfig -> Gemma3ForCausalLM, as transformers names the text-only model
    cfg["architectures"] = [type(config).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return cfg, tokenizer, types


def convert(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the checkpoint directory for `gguf_file` into `out_dir` (replaced whole)."""
    gguf_file, out = Path(gguf_file).resolve(), Path(out_dir)
    started = time.perf_counter()
    reader = _reader(gguf_file)
    cfg, tokenizer, types = _hf_config(reader, gguf_file)
    del reader
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users of the cache
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(_marker(gguf_file)))
        shutil.rmtree(out, ignore_errors=True)  # an older format's folder goes whole, its weights with it
        try:
            os.replace(tmp, out)
        except OSError:
            if not is_converted(out, gguf_file):
                raise
            shutil.rmtree(tmp)  # a concurrent converter (another Triton instance) finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("splitfuse: converted %s (%s, tensor types %s) into %s in %.1f s (config and tokenizer; the weights "
             "are read from the file at load)", gguf_file.name, cfg.get("model_type"), ", ".join(sorted(types)), out,
             time.perf_counter() - started)
    return out


# GGUF block types the packed kernels multiply (kernels/cpu/quant4.py).
PACKED_TYPES = GGUF_BLOCK_KINDS


class GGUFSource:
    """The GGUF file a checkpoint directory was converted from, opened on first use."""

    def __init__(self, gguf_file: Path) -> None:
        self.file = gguf_file
        self._tensors: GGUFTensors | None = None

    def tensors(self) -> GGUFTensors:
        if self._tensors is None:
            try:  # the index alone: gguf's reader would hold the whole tokenizer (gguf_index.py)
                fields, index = read_index(self.file)
            except ValueError as e:
                raise GGUFError(f"{self.file} is not a readable GGUF file ({e})") from e
            arch = fields.get("general.architecture")
            heads = int(fields[f"{arch}.attention.head_count"])
            kv = fields.get(f"{arch}.attention.head_count_kv")
            self._tensors = GGUFTensors(index, self.file, arch, heads, heads if kv is None else int(kv))
        return self._tensors

    def quantized(self) -> bool:
        """Whether any of the file's tensors is in a block type the packed kernel takes."""
        return any(t.tensor_type.name in PACKED_TYPES for _, t in self.tensors())

    def packed_kind(self, hf_names: list[str]) -> str | None:
        """The block type the packed kernel takes the named weights in (stacked in order: a fused
        projection's parts), read from the file's index alone; None unless every part is stored in
        a type of PACKED_TYPES. Parts of different types: their types joined by "+", in order
        (each part is then packed in its own type: kernels/cpu/quant_parts.py)."""
        tensors = self.tensors()
        kinds = []
        for hf in hf_names:
            t = tensors.of(hf)
            if t is None or t.tensor_type.name not in PACKED_TYPES:
                return None
            kinds.append(t.tensor_type.name)
        return kinds[0] if len(set(kinds)) == 1 else "+".join(kinds)

    def blocks(self, hf_names: list[str]) -> tuple[str, torch.Tensor] | None:
        """(block type, uint8 rows [N, K / 32 * block bytes]) of the named Hugging Face weights
        stacked in order (a fused projection's parts), in Hugging Face's row order; None where
        packed_kind is."""
        kind = self.packed_kind(hf_names)
        if kind is None:
            return None
        tensors = self.tensors()
        parts = [tensors.raw_rows(tensors.of(hf)) for hf in hf_names]
        if "+" in kind:  # parts of different types, as quant_parts carries them
            return quant_parts.join(list(zip(kind.split("+"), parts)))
        return kind, parts[0] if len(parts) == 1 else torch.cat(parts)


def gguf_source(checkpoint_dir: str | os.PathLike) -> GGUFSource | None:
    """The source of a directory `convert` wrote (this format), when that file is still there
    unchanged."""
    try:
        key = json.loads((Path(checkpoint_dir) / _MARKER).read_text())
        source = Path(key["source"])
        if not source.is_file() or _marker(source) != key:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return GGUFSource(source)


def transformers_location(checkpoint_dir: str | os.PathLike) -> tuple[str, dict]:
    """(path, extra from_pretrained arguments) with which transformers reads this checkpoint's
    weights: a converted GGUF folder holds none, so its source file (`gguf_file=`)."""
    source = gguf_source(checkpoint_dir)
    if source is None:
        return os.fspath(checkpoint_dir), {}
    return str(source.file.parent), {"gguf_file": source.file.name}


if __name__ == "__main__":
    import argparse

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description="Convert a GGUF checkpoint into a checkpoint directory (once).")
    p.add_argument("gguf", help="a .gguf file, or a directory holding one")
    p.add_argument("out", nargs="?", default=None, help="output directory (default: the GGUF cache)")
    a = p.parse_args()
    try:
        print(prepare_checkpoint(a.gguf, a.out))
    except GGUFError as e:
        raise SystemExit(f"error: {e}")
