"""The runner's rotary tables for every rope type we run, as transformers computes them.

default, linear and llama3 only change the inverse frequencies (rotary.py). yarn also scales
cos/sin by an attention factor. longrope has two frequency sets: the table holds the short
factors' rows [0, max_positions) and, after them, the long factors' rows [long_offset, 2 *
long_offset); a sequence reads one set for its whole life (Sequence.rope_offset), chosen by its
prompt length, so the K in its cache (and in cached prefixes, whose hash includes the choice)
was rotated the way its later tokens are. dynamic NTK equals the default rope up to
max_position_embeddings and is refused beyond it (its frequencies would change with each step's
length, which rotated keys already in the cache cannot follow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitfuse.layers.rotary import rope_cos_sin, rope_inverse_frequencies, rope_type


@dataclass
class RopeTables:
    cos: torch.Tensor  # float32 [rows, rotary_dim / 2]
    sin: torch.Tensor
    long_offset: int = 0  # longrope: where the long factors' rows start; 0: a single set
    switch_length: int = 0  # longrope: prompts longer than this read the long set

    def offset_for(self, prompt_len: int) -> int:
        """The row offset a sequence with a prompt of `prompt_len` tokens reads its rope at."""
        return self.long_offset if self.long_offset and prompt_len > self.switch_length else 0


def build_rope_tables(rotary_dim: int, theta: float, scaling: dict | None, max_positions: int,
                      max_position_embeddings: int) -> RopeTables:
    """Tables for positions [0, max_positions); NotImplementedError names a rope type (or an
    option) we do not run."""
    kind = rope_type(scaling)
    if kind == "yarn":
        inv_freq, factor = yarn_parameters(rotary_dim, theta, scaling, max_position_embeddings)
        return _scaled(inv_freq, factor, max_positions)
    if kind == "longrope":
        short, long, factor = longrope_parameters(rotary_dim, theta, scaling, max_position_embeddings)
        cos_s, sin_s = _scaled_cos_sin(short, factor, max_positions)
        cos_l, sin_l = _scaled_cos_sin(long, factor, max_positions)
        return RopeTables(torch.cat([cos_s, cos_l]), torch.cat([sin_s, sin_l]), max_positions,
                          int(scaling["original_max_position_embeddings"]))
    if kind == "dynamic":
        if max_positions > max_position_embeddings:
            raise NotImplementedError(
                f"rope type 'dynamic' (dynamic NTK) runs only up to max_position_embeddings="
                f"{max_position_embeddings} (where it is the default rope); max_model_len={max_positions} is "
                f"beyond: its frequencies would change with each step's length, which keys already in the KV "
                f"cache cannot follow. Set max_model_len <= {max_position_embeddings}")
        return _scaled(rope_inverse_frequencies(rotary_dim, theta, None), 1.0, max_positions)
    return _scaled(rope_inverse_frequencies(rotary_dim, theta, scaling), 1.0, max_positions)


def _scaled_cos_sin(inv_freq: torch.Tensor, factor: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(inv_freq, max_positions)
    if factor != 1.0:  # transformers multiplies cos and sin (float32) by the attention factor
        cos, sin = cos * factor, sin * factor
    return cos, sin


def _scaled(inv_freq: torch.Tensor, factor: float, max_positions: int) -> RopeTables:
    return RopeTables(*_scaled_cos_sin(inv_freq, factor, max_positions))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies ramped between interpolated (/ factor) and kept, by rotations over the
    original context (beta_fast, beta_slow; `truncate` rounds the ramp's ends outwards); and
    the attention factor (given, or from mscale / mscale_all_dim, or 0.1 ln(factor) + 1)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def longrope_parameters(dim: int, theta: float, scaling: dict,
                        max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE: the short and the long factors' inverse frequencies (each factor divides one
    frequency) and the attention factor (given, else from max_position_embeddings / the original
    context: sqrt(1 + ln(scale) / ln(original)))."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        factors = torch.tensor(scaling[key], dtype=torch.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(f"rope_scaling {key} has {factors.numel()} values; the rotary dimension {dim} "
                             f"needs {dim // 2}")
        out.append(1.0 / (factors * theta**shape))
    return out[0], out[1], float(attention_factor)
