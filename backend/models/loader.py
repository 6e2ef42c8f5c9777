"""Load a checkpoint directory: a Hugging Face one (config.json + safetensors, sharded or not), or
one converted from a GGUF file, whose weights are read from that file (gguf_loader.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from splitfuse.models.args import ModelArgs
from splitfuse.models.gguf_checkpoint import gguf_source
from splitfuse.models.gguf_loader import AllReduce, Shard, load_gguf
from splitfuse.models.layer_range import LayerRange
from splitfuse.models.llama import LlamaForCausalLM
from splitfuse.models.registry import causal_lm_class
from splitfuse.models.weight_load import check_loaded, load_one
from splitfuse.utils.process_memory import peak_resident_bytes

log = logging.getLogger(__name__)


def read_hf_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: `model` must be a local HF checkpoint directory")
    return json.loads(config_file.read_text())


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_model(path: str | Path, args: ModelArgs, ops, dtype: torch.dtype, device: torch.device,
               shard: Shard | None = None, all_reduce: AllReduce | None = None,
               quantization: str = "none", layers: LayerRange | None = None) -> LlamaForCausalLM:
    """Build the model and read its weights. For a tensor-parallel rank, `args` carries the rank's
    local sizes, `shard` cuts each checkpoint tensor to the rank's part and `all_reduce` sums the
    row-parallel partial outputs across ranks. `quantization` (EngineConfig's): under "gguf" /
    "gguf-exact" the projections a GGUF file stores in packed block types are not read as floats
    at all (their blocks are, by prepare_linears). A pipeline stage's `layers` is the part of
    the model it builds and reads."""
    with torch.device("meta"):
        model = causal_lm_class(args)(args, ops, all_reduce)
    if layers is not None:
        layers.cut(model)
    source = gguf_source(path)
    if source is not None:
        load_gguf(model, source, dtype, device, shard, quantization, layers)
        return model.eval()
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    # A model class may name checkpoint tensors its own way, or skip some (None): Gemma 3's
    # multimodal checkpoints hold the text model under a prefix, beside a vision tower.
    rename = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key if rename is None else rename(key)
                if name is not None and layers is not None:
                    name = layers.checkpoint_name(name)
                if name is None or "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue
                tensor = f.get_tensor(key)
                load_one(params, name, tensor if shard is None else shard(name, tensor), args, loaded)
    check_loaded(params, loaded, args, path)
    return model.eval()



def log_load(path: str | Path, seconds: float, weights: str) -> None:
    """One log line: the weights' source and its size, the time they took to load and pack, what
    they hold in memory, and the process's peak resident memory so far."""
    source = gguf_source(path)
    files = [source.file] if source is not None else safetensors_files(path)
    size = sum(f.stat().st_size for f in files)
    peak = peak_resident_bytes()
    log.info("splitfuse: weights from %s (%.2f GB on disk) loaded in %.1f s: %s; process peak RSS %.2f GB",
             files[0] if len(files) == 1 else path, size / 1e9, seconds, weights, peak / 1e9)
