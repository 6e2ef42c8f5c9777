"""Reading one PEFT LoRA folder and checking it against the base model, at load.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors` with, per adapted
projection, `lora_A.weight` [r, in] and `lora_B.weight` [out, r]; the projection's output gains
`(x @ A^T) @ B^T * scale`, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

The engine fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's weights
are kept per fused projection: the A matrices of its parts side by side (one product for all of
them) and each part's B (scale folded in) with the output columns it adds to.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

Kernel = Callable[[torch.Tensor], torch.Tensor]
MakeKernel = Callable[[torch.Tensor], Kernel]
"""weight [out, in] -> a function computing x @ weight^T (the engine passes its linear backend's,
so the small LoRA products run the same kernels as the base: on CPUs several times faster than
torch.matmul at these shapes)."""


def plain_kernel(weight: torch.Tensor) -> Kernel:
    return lambda x: F.linear(x, weight)


# HF projection name -> (our projection, its part index within it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<target>\w+))\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")

# adapter_config.json settings that change the computation in ways the engine does not run.
# name -> (value meaning "off", why it is refused)
_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "use_dora": (False, "DoRA (use_dora) is not supported"),
    "lora_bias": (False, "lora_bias (a bias on lora_B) is not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D-style weights) is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained modules) is not supported"),
    "trainable_token_indices": (None, "trainable_token_indices (trained embedding rows) is not supported"),
    "target_parameters": (None, "target_parameters is not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) is not supported"),
    "use_qalora": (False, "QA-LoRA (use_qalora) is not supported"),
}


@dataclass(frozen=True)
class BaseShape:
    """What an adapter must fit: the base model's sizes (from its config)."""

    num_layers: int
    hidden_size: int
    q_size: int
    kv_size: int
    intermediate_size: int
    moe: bool = False

    def in_out(self, target: str) -> tuple[int, int]:
        """(input, output) features of an HF projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[target]

    def part_offsets(self, projection: str) -> list[int]:
        """Output column where each part of one of our projections starts, and the end last."""
        if projection == "qkv_proj":
            return [0, self.q_size, self.q_size + self.kv_size, self.q_size + 2 * self.kv_size]
        if projection == "gate_up_proj":
            return [0, self.intermediate_size, 2 * self.intermediate_size]
        return [0, self.hidden_size]


@dataclass
class LoraPart:
    """One HF projection inside a fused one: its B adds to output columns [out_start, out_end)
    from ranks [rank_start, rank_end) of the fused product x @ A."""

    out_start: int
    out_end: int
    rank_start: int
    rank_end: int
    b: torch.Tensor  # [rank_end - rank_start, out_end - out_start], scale folded in


@dataclass
class ProjectionLora:
    """An adapter's weights for one of our projections in one layer."""

    a: torch.Tensor  # [in, total rank]: the parts' A^T side by side
    parts: list[LoraPart]
    out_features: int
    a_kernel: Kernel | None = field(default=None, repr=False)  # x @ a, set by LoraAdapter.pack
    b_kernel: Kernel | None = field(default=None, repr=False)
    """(x @ a) @ every part's B at once, set by LoraAdapter.pack: [total rank, out_features] with each
    part's B in its rank rows and output columns, zeros elsewhere. One product and one add per
    projection instead of one per part: the zero terms add exactly nothing, and the calls saved
    (each a few microseconds, and a strided add into a column slice) cost more than they do."""

    @property
    def covers_output(self) -> bool:
        """One part over every output column (no slicing needed)."""
        return len(self.parts) == 1 and self.parts[0].out_end - self.parts[0].out_start == self.out_features


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its projections' ranks
    targets: frozenset[str]  # HF projection names it adapts
    projections: dict[tuple[int, str], ProjectionLora] = field(repr=False)
    """(layer, our projection name) -> weights."""
    digest: str = ""
    """SHA-256 of adapter_config.json and adapter_model.safetensors as read: the registry
    refuses a re-read whose content differs (the prefix cache holds KV of the weights first read)."""

    def keep_layers(self, layers: range) -> "LoraAdapter":
        """Only the projections of `layers` (a pipeline stage's), keyed by their index in it."""
        self.projections = {(layer - layers.start, name): p for (layer, name), p in self.projections.items()
                            if layer in layers}
        return self

    def to(self, device: torch.device, dtype: torch.dtype) -> "LoraAdapter":
        for p in self.projections.values():
            p.a = p.a.to(device=device, dtype=dtype).contiguous()
            for part in p.parts:
                part.b = part.b.to(device=device, dtype=dtype).contiguous()
        return self

    def pack(self, make_kernel: MakeKernel = plain_kernel) -> "LoraAdapter":
        """Build the products' kernels (after `to`)."""
        for p in self.projections.values():
            p.a_kernel = make_kernel(p.a.t().contiguous())
            p.b_kernel = make_kernel(fused_b(p.parts, p.a.shape[1], p.out_features, lambda q: q.rank_start,
                                             lambda q: q.rank_end).t().contiguous())
        return self


def fused_b(parts: list, rows: int, out_features: int, row_start: Callable, row_end: Callable) -> torch.Tensor:
    """[rows, out_features]: each part's `b` at its rows [row_start, row_end) and its output
    columns [out_start, out_end), zeros elsewhere."""
    first = parts[0].b
    b = torch.zeros(rows, out_features, dtype=first.dtype, device=first.device)
    for part in parts:
        b[row_start(part):row_end(part), part.out_start:part.out_end] = part.b
    return b


def read_adapter_config(path: Path) -> tuple[dict, bytes]:
    """The folder's adapter_config.json, parsed, and its bytes."""
    config_file = path / CONFIG_FILE
    if not path.is_dir():
        raise ValueError(f"LoRA adapter folder {path} does not exist")
    if not config_file.is_file():
        raise ValueError(f"{config_file} not found: a LoRA adapter is a PEFT folder (adapter_config.json + "
                         f"{WEIGHTS_FILE})")
    try:
        raw = config_file.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: cannot read it as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    return config, raw


def check_adapter_config(config: dict, config_file: Path, max_rank: int) -> None:
    """Refuse what the engine would compute differently from PEFT."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{config_file}: peft_type {peft_type!r} is not LoRA")
    for name, (off, why) in _UNSUPPORTED.items():
        value = config.get(name, off)
        if value not in (off, None, False, [], {}):
            raise ValueError(f"{config_file}: {why} (got {name}={value!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias={config['bias']!r}: only bias='none' is supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        leaves = {str(t).rsplit(".", 1)[-1] for t in targets}
        other = sorted(leaves - set(TARGETS))
        if other:
            raise ValueError(f"{config_file}: target_modules {other} are not supported; LoRA applies to "
                             f"{', '.join(TARGETS)}")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{config_file}: r must be a positive integer, got {r!r}")
    ranks = [r, *config.get("rank_pattern", {}).values()]
    if max(ranks) > max_rank:
        raise ValueError(f"{config_file}: rank {max(ranks)} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{config_file}: lora_alpha must be a number, got {alpha!r}")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(name: str, path: str | Path, base: BaseShape, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT folder (weights on the CPU in float32). Raises ValueError naming the
    file and the problem."""
    path = Path(path)
    config, raw_config = read_adapter_config(path)
    config_file = path / CONFIG_FILE
    check_adapter_config(config, config_file, max_rank)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        what = " (adapter_model.bin is not read: save with safe_serialization)" if (
            path / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{weights_file} not found{what}")
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    # Read once: the digest and the tensors come from the same bytes.
    try:
        data = weights_file.read_bytes()
        read = load_safetensors(data)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{weights_file}: cannot read it as safetensors: {e}") from None
    digest = hashlib.sha256(raw_config + b"\0" + data).hexdigest()
    for key, tensor in read.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{weights_file}: tensor {key!r} is not a LoRA weight of {', '.join(TARGETS)} "
                             "(embed_tokens / lm_head and other modules are not supported)")
        layer, target = int(match["layer"]), match["target"]
        if target not in TARGETS:
            raise ValueError(f"{weights_file}: tensor {key!r} adapts {target!r}; LoRA applies to "
                             f"{', '.join(TARGETS)} only")
        tensors.setdefault((layer, target), {})[match["ab"]] = tensor.float()
        modules[(layer, target)] = match["module"]
    if not tensors:
        raise ValueError(f"{weights_file}: holds no LoRA weights")
    alpha = float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    per_part: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
    for (layer, target), ab in sorted(tensors.items()):
        where = f"{weights_file}: layer {layer} {target}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
        if layer >= base.num_layers:
            raise ValueError(f"{where}: the base model has {base.num_layers} layers (adapter made for another model?)")
        if base.moe and target in MLP_TARGETS:
            raise ValueError(f"{where}: the base model's MLP is a mixture of experts; LoRA applies to its attention "
                             "projections only")
        a, b = ab["A"], ab["B"]
        n_in, n_out = base.in_out(target)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not share a rank")
        r = a.shape[0]
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                             f"model's {target} ({n_in} inputs, {n_out} outputs): hidden size mismatch, adapter "
                             "made for another model?")
        module = modules[(layer, target)]
        expected_r = _pattern_value(rank_pattern, module, config["r"])
        if r != expected_r:
            raise ValueError(f"{where}: rank {r} differs from adapter_config.json's r={expected_r}")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} exceeds max_lora_rank={max_rank}")
        module_alpha = float(_pattern_value(alpha_pattern, module, alpha))
        scale = module_alpha / math.sqrt(r) if config.get("use_rslora") else module_alpha / r
        projection, part = TARGETS[target]
        per_part.setdefault((layer, projection), []).append((part, a, b, scale))
    projections = {key: _fuse(key[1], parts, base) for key, parts in per_part.items()}
    return LoraAdapter(name=name, path=str(path), rank=max(p.a.shape[1] for p in projections.values()),
                       targets=frozenset(t for _, t in tensors), projections=projections, digest=digest)


def _fuse(projection: str, parts: list[tuple[int, torch.Tensor, torch.Tensor, float]],
          base: BaseShape) -> ProjectionLora:
    offsets = base.part_offsets(projection)
    a_cols, out_parts, rank = [], [], 0
    for part, a, b, scale in sorted(parts, key=lambda p: p[0]):
        r = a.shape[0]
        a_cols.append(a.t())
        out_parts.append(LoraPart(offsets[part], offsets[part + 1], rank, rank + r, (b * scale).t().contiguous()))
        rank += r
    return ProjectionLora(a=torch.cat(a_cols, dim=1).contiguous(), parts=out_parts, out_features=offsets[-1])
