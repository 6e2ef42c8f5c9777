"""GGUF checkpoints (llama.cpp's single-file format) as plain Hugging Face checkpoints.

`prepare_checkpoint(model)` takes what `EngineConfig.model` names: a checkpoint directory is
returned as it is; a `.gguf` file, or a directory holding one (and no config.json), is converted
once into a directory beside the others in the cache (`gguf_cache_dir()`) and that directory is
returned, so the engine, the Triton models and the OpenAI front all read one ordinary checkpoint.
A later call with the same file (path, size and modification time) finds the conversion.

The conversion:
- weights: every tensor dequantized with the `gguf` package (Q4_0, Q4_1, Q5_*, Q8_0, the
  K-quants and whatever else it can dequantize) to float32; F32/F16/BF16 tensors keep their
  type. llama.cpp stores Llama/Mistral q and k projections with each head's rotary halves
  interleaved; they are put back in Hugging Face's order. The config's `dtype` is the
  checkpoint's float type where every matrix was stored unquantized in it, else float32 (the
  dequantized values are exact in float32, not in bf16).
- config and tokenizer: from the file's metadata through transformers' own GGUF readers (the
  same reference the tests compare against), the chat template included.

The converted directory records its source file (`splitfuse_gguf.json`): with
`EngineConfig.quantization="gguf"` or "gguf-exact" the loader reads the projections' quantized
blocks from it (`gguf_source`, `GGUFSource.blocks`) and the engine multiplies them packed
(layers/q4_linear.py).

Dense Llama-family architectures (llama, mistral, qwen2, qwen3), Phi-3 / Phi-4-mini (phi3:
gguf_phi3.py), Gemma 3 (gemma3: gguf_gemma3.py) and Qwen3-MoE (qwen3moe, its experts through
gguf_moe.py) are taken; any other architecture, another mixture-of-experts file, a tensor type
`gguf` cannot dequantize, or a file that is not GGUF or is
cut short raises GGUFError naming what is wrong. Conversion time and peak memory are logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from splitfuse.models.gguf_gemma3 import configure_gemma3, gemma3_hf_name, is_shifted_norm
from splitfuse.models.gguf_phi3 import ROPE_FACTOR_TENSORS, configure_phi3, phi3_gguf_name, phi3_hf_name
from splitfuse.models.gguf_names import layer_hf_name
from splitfuse.models.gguf_moe import MOE_ARCHITECTURES, GGUFMoeError, configure_moe, expert_hf_name, merge_experts
from splitfuse.utils.cache_dir import cache_dir as splitfuse_cache_dir

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
# llama.cpp's converter interleaves the rotary halves of q/k for these (not for qwen2, qwen3).
_PERMUTED_QK = ("llama", "mistral")
_CACHE_ENV = "SPLITFUSE_GGUF_CACHE"
_MARKER = "splitfuse_gguf.json"  # written last: a directory without it is not a finished conversion
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Tensors that carry no weights of ours (llama.cpp's precomputed rotary factors; rope scaling comes
# from the metadata through the config, and Phi-3's LongRoPE factors through gguf_phi3.py).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, cut short, or of an unsupported kind."""


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


def is_converted(out_dir: Path, gguf_file: Path) -> bool:
    marker = out_dir / _MARKER
    try:
        return json.loads(marker.read_text()) == _source_key(gguf_file)
    except (OSError, ValueError):
        return False


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


def _unpermute_rotary(w: torch.Tensor, heads: int, name: str, field: str) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (per head: pairs interleaved) into Hugging Face's (halves).
    `field` is the metadata key `heads` came from, named when the two disagree."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise GGUFError(f"tensor {name!r} has {rows} rows, which {field} = {heads} does not split into heads of "
                        f"an even number of rows: the file's metadata and tensors disagree")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    return layer_hf_name(name, _LAYER_NAMES)


def _tensors(reader, arch: str, num_heads: int, num_kv_heads: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every weight as a torch tensor under its Hugging Face name, and the GGUF types seen."""
    import gguf

    plain = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
             gguf.GGMLQuantizationType.BF16: torch.bfloat16}
    out: dict[str, torch.Tensor] = {}
    types: set[str] = set()
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = ((gemma3_hf_name(t.name) if arch == "gemma3" else None)
                or (phi3_hf_name(t.name) if arch == "phi3" else None) or _hf_name(t.name)
                or (expert_hf_name(t.name) if arch in MOE_ARCHITECTURES else None))
        if name is None:
            what = "mixture-of-experts tensors" if "_exps" in t.name or "ffn_gate_inp" in t.name else "a tensor"
            raise GGUFError(f"{arch} GGUF with {what} this engine does not load: {t.name!r}")
        kind = t.tensor_type
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
        types.add(kind.name)
        try:
            if kind in plain:
                data = torch.from_numpy(t.data.copy())
                if kind == gguf.GGMLQuantizationType.BF16:  # stored as raw 16-bit words
                    data = data.view(torch.bfloat16)
                tensor = data.reshape(shape)
            else:
                tensor = torch.from_numpy(gguf.quants.dequantize(t.data, kind)).reshape(shape)
        except NotImplementedError as e:
            raise GGUFError(f"tensor {t.name!r} has type {kind.name}, which the gguf package cannot dequantize") from e
        except (ValueError, IndexError, RuntimeError) as e:  # a short data region
            raise GGUFError(f"tensor {t.name!r} ({kind.name}, shape {shape}) could not be read: {e}") from e
        if arch in _PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            tensor = _unpermute_rotary(tensor, num_heads, t.name, f"{arch}.attention.head_count")
        elif arch in _PERMUTED_QK and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            tensor = _unpermute_rotary(tensor, num_kv_heads, t.name, f"{arch}.attention.head_count_kv")
        elif arch == "gemma3" and is_shifted_norm(t.name):  # stored as 1 + w (gguf_gemma3.py)
            tensor = tensor.float() - 1
        out[name] = tensor.contiguous()
    return out, types


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


def _checkpoint_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The float type all matrices share when none was quantized, else float32."""
    kinds = {t.dtype for t in tensors.values() if t.dim() >= 2}
    return str(kinds.pop()).removeprefix("torch.") if len(kinds) == 1 else "float32"


def convert(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the checkpoint directory for `gguf_file` into `out_dir` (replaced whole)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    gguf_file, out = Path(gguf_file).resolve(), Path(out_dir)
    started = time.perf_counter()
    reader = _reader(gguf_file)
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
    if arch in ("qwen3", "qwen3moe"):
        config.head_dim = _qwen3_head_dim(reader, gguf_file.name, config, arch)
    if arch in MOE_ARCHITECTURES:
        _configure_moe(reader, arch, config, gguf_file.name)
    if arch == "gemma3":
        try:
            configure_gemma3(lambda key: _field(reader, key), config, gguf_file.name)
        except ValueError as e:
            raise GGUFError(str(e)) from e
    if arch == "phi3":
        factors = {t.name: t.data for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
        try:
            configure_phi3(lambda key: _field(reader, key), factors, config, gguf_file.name)
        except ValueError as e:
            raise GGUFError(str(e)) from e
    tensors, types = _tensors(reader, arch, config.num_attention_heads, config.num_key_value_heads)
    merge_experts(tensors)
    del reader
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = _checkpoint_dtype(tensors)
    # Gemma3TextConfig -> Gemma3ForCausalLM, as transformers names the text-only model
    cfg["architectures"] = [type(config).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users of the cache
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        (tmp / "model.safetensors").chmod(0o644)
        (tmp / _MARKER).write_text(json.dumps(_source_key(gguf_file)))
        shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not is_converted(out, gguf_file):
                raise
            shutil.rmtree(tmp)  # a concurrent converter (another Triton instance) finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(t.numel() for t in tensors.values())
    log.info("splitfuse: converted %s (%s, %.1fM parameters, tensor types %s) into %s in %.1f s, "
             "process peak memory %.0f MiB", gguf_file.name, arch, params / 1e6, ", ".join(sorted(types)), out,
             time.perf_counter() - started, peak_mb)
    return out


# GGUF block types the packed kernels multiply (kernels/cpu/quant4.py).
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_GGUF_NAMES = {hf: gg for gg, hf in _LAYER_NAMES.items()}
_GGUF_TOP = {hf: gg for gg, hf in _TOP_NAMES.items()}


def _gguf_name(hf_name: str) -> str | None:
    if hf_name in _GGUF_TOP:
        return _GGUF_TOP[hf_name]
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        if rest in _GGUF_NAMES:
            return f"blk.{layer}.{_GGUF_NAMES[rest]}"
    return phi3_gguf_name(hf_name)


class GGUFSource:
    """The quantized tensors of the GGUF file a checkpoint directory was converted from, read on
    first use (a float32 engine never opens the file)."""

    def __init__(self, gguf_file: Path) -> None:
        self.file = gguf_file
        self._tensors: dict | None = None

    def _open(self) -> dict:
        if self._tensors is None:
            reader = _reader(self.file)
            self._arch = _field(reader, "general.architecture")
            self._heads = int(_field(reader, f"{self._arch}.attention.head_count"))
            kv = _field(reader, f"{self._arch}.attention.head_count_kv")
            self._kv_heads = self._heads if kv is None else int(kv)
            self._tensors = {t.name: t for t in reader.tensors}
        return self._tensors

    def blocks(self, hf_names: list[str]) -> tuple[str, torch.Tensor] | None:
        """(block type, uint8 rows [N, K / 32 * block bytes]) of the named Hugging Face weights
        stacked in order (a fused projection's parts), in Hugging Face's row order; None unless
        every part is stored in one type of PACKED_TYPES."""
        tensors = self._open()
        kinds, parts = set(), []
        for hf in hf_names:
            t = tensors.get(_gguf_name(hf) or "")
            if t is None or t.tensor_type.name not in PACKED_TYPES:
                return None
            kinds.add(t.tensor_type.name)
            rows = torch.from_numpy(t.data.copy()).view(torch.uint8)
            rows = rows.reshape(int(t.shape[-1]), -1)  # GGUF lists dimensions innermost first
            if self._arch in _PERMUTED_QK and t.name.endswith("attn_q.weight"):
                rows = _unpermute_rotary(rows, self._heads, t.name, f"{self._arch}.attention.head_count")
            elif self._arch in _PERMUTED_QK and t.name.endswith("attn_k.weight"):
                rows = _unpermute_rotary(rows, self._kv_heads, t.name, f"{self._arch}.attention.head_count_kv")
            parts.append(rows)
        if len(kinds) != 1:
            return None
        return kinds.pop(), torch.cat(parts).contiguous()


def gguf_source(checkpoint_dir: str | os.PathLike) -> GGUFSource | None:
    """The source of a directory `convert` wrote, when that file is still there unchanged."""
    try:
        key = json.loads((Path(checkpoint_dir) / _MARKER).read_text())
        source = Path(key["source"])
        if not source.is_file() or _source_key(source) != key:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return GGUFSource(source)


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
