"""A model's weights read from the GGUF file its checkpoint directory was converted from
(gguf_checkpoint.py), one tensor at a time, at about the file's size in memory.

The model is built on the meta device (no storage). Under quantization "gguf" / "gguf-exact",
where the packed block kernel runs (float32, the C++ kernels built), each projection whose
blocks that kernel takes (`GGUFSource.packed_kind`) keeps its weight on the meta device: it is
never allocated in float, and `prepare_linears` packs its blocks straight from the file
(`Linear.gguf_blocks`); so does the embedding where it looks its rows up in blocks. Every other
parameter is given storage in the engine's dtype and filled from its tensor, dequantized alone
(gguf_tensors.py); each tensor's bytes are copied out of the file and let go before the next.
The start time and peak memory are logged by the model runner once the kernels are packed.

A pipeline stage (`layers`) reads only its own layers' tensors (and the embedding, final norm
and head where it holds them), renamed to its local layer indices; the packed blocks of its
projections are looked up in the file under their global names. Blocks are whole rows, so a
stage keeps them as they are (a tensor-parallel shard could not).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from splitfuse.config import GGUF_QUANTIZATIONS
from splitfuse.kernels.cpu import quant4
from splitfuse.layers.linear import Linear
from splitfuse.layers.q4_linear import q4_supported
from splitfuse.models.gguf_checkpoint import GGUFSource
from splitfuse.models.gguf_tensors import GGUFError
from splitfuse.models.gguf_moe import GGUFMoeError, merge_experts
from splitfuse.models.layer_range import LayerRange
from splitfuse.models.weight_load import FUSED, check_loaded, load_one

log = logging.getLogger(__name__)

# (checkpoint tensor name, tensor) -> the part this tensor-parallel rank keeps (parallel/sharding.py)
Shard = Callable[[str, torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]
_EMBED = "model.embed_tokens.weight"
_STACKED = (".mlp.experts.gate_proj", ".mlp.experts.up_proj")  # joined into experts.gate_up_proj


def load_gguf(model: nn.Module, source: GGUFSource, dtype: torch.dtype, device: torch.device,
              shard: Shard | None, quantization: str, layers: LayerRange | None = None) -> None:
    """Fill `model` (built on the meta device, cut to `layers` for a pipeline stage) from
    `source`; see the module's docstring."""
    args = model.args
    blocks_here = (shard is None and quantization in GGUF_QUANTIZATIONS and q4_supported(device, dtype)[0])
    unread = attach_gguf_blocks(model, source, blocks_here, layers) if shard is None else {}
    materialise(model, dtype, device, {id(p) for p in unread.values()})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set(unread)
    skipped = {hf for name in unread for hf in [name, *_read_as(name)]}  # a fused one's parts, or itself (Phi-3)
    rename = getattr(model, "checkpoint_name", None)
    stacked: dict[str, torch.Tensor] = {}
    tensors = source.tensors()
    for name, t in tensors:
        name = name if rename is None or name is None else rename(name)
        if name is not None and layers is not None:
            name = layers.checkpoint_name(name)  # local index; None for another stage's tensor
        if name is None or name in skipped:
            continue
        tensor = tensors.read(t, dtype)
        if name.endswith(_STACKED):  # a layer's gate and up experts, joined once both are read
            stacked[name] = tensor
            joined = _join_experts(stacked, name)
            if joined is None:
                continue
            name, tensor = joined
        load_one(params, name, tensor if shard is None else shard(name, tensor), args, loaded)
        del tensor
    if stacked:
        raise GGUFError(f"{source.file.name}: {sorted(stacked)[0]} has no matching gate or up experts")
    check_loaded(params, loaded, args, source.file)


def _read_as(param_name: str) -> list[str]:
    """The checkpoint tensors (ours, Hugging Face's names) a parameter is filled from."""
    parts = [hf for hf, (ours, _) in FUSED.items() if ours in param_name]
    return [param_name.replace(FUSED[p][0], p) for p in parts] or [param_name]


def _join_experts(stacked: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    prefix = name.rsplit(".", 1)[0]
    pair = [prefix + ".gate_proj", prefix + ".up_proj"]
    if not all(n in stacked for n in pair):
        return None
    part = {n: stacked.pop(n) for n in pair}
    try:
        merge_experts(part)
    except GGUFMoeError as e:
        raise GGUFError(str(e)) from e
    return next(iter(part.items()))


def attach_gguf_blocks(model: nn.Module, source: GGUFSource, leave_unread: bool,
                       layers: LayerRange | None = None) -> dict[str, nn.Parameter]:
    """Give each projection, the LM head and the embedding the means to read its weight's blocks
    from the file (read when quantization="gguf" or "gguf-exact" prepares it). A tied head reads
    the embedding's blocks, and so does the embedding. With `leave_unread`: the parameters, by
    (local) name, whose blocks the kernels take, left on the meta device for them. A pipeline
    stage's `layers` give its modules' names in the file."""
    unread: dict[str, nn.Parameter] = {}
    tied = model.args.tie_word_embeddings
    embedding = model.model.embed_tokens
    if embedding is not None:  # None on a pipeline stage after the first, without a tied head
        embedding.gguf_blocks = lambda: source.blocks([_EMBED])
        # The embedding looks rows up in blocks of quant4's kinds: its own, or a tied head's packing.
        if leave_unread and source.packed_kind([_EMBED]) in quant4.KINDS:
            unread[_EMBED] = embedding.weight
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if module is model.lm_head:
            candidates = [[_EMBED if tied else "lm_head.weight"]]
        else:
            # Its parts in the file, or (Phi-3's attn_qkv, ffn_up: stored fused) itself by our name.
            in_file = f"{name}.weight" if layers is None else layers.global_name(f"{name}.weight")
            candidates = [_read_as(in_file), [in_file]]
        module.gguf_blocks = lambda c=candidates: next((b for names in c if (b := source.blocks(names))), None)
        if leave_unread and not (module is model.lm_head and tied):
            if any(source.packed_kind(names) for names in candidates):
                unread[f"{name}.weight"] = module.weight
    return unread


def materialise(model: nn.Module, dtype: torch.dtype, device: torch.device, unread: set[int]) -> None:
    """Give every parameter and buffer on the meta device empty storage on `device` (floating
    ones in `dtype`), but the parameters whose ids are in `unread`. A parameter shared by two
    modules (a tied head) stays shared."""
    made: dict[int, torch.Tensor] = {}

    def storage(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta and id(p) not in unread:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(storage(p), requires_grad=p.requires_grad)
                module._parameters[key] = made[id(p)]
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[key] = storage(b)
