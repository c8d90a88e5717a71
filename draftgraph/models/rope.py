"""Rotary position embedding: inverse frequencies (default, linear, llama3, yarn) and the cos/sin table."""

from __future__ import annotations

import math

import torch

from draftgraph.models.config import RopeConfig, yarn_mscale
from draftgraph.ops.rope.op import rotate_half


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, as transformers computes them."""
    freqs = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return freqs / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_wavelen, freqs / rope.factor, freqs)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, freqs)
    return freqs


def _yarn_inv_freq(rope: RopeConfig, dim: int, extrapolation: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolate (divide by factor) the long wavelengths, keep the short ones, ramp between the
    dimensions that rotate beta_fast and beta_slow times over the original context."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return extrapolation / rope.factor * (1 - keep) + extrapolation * keep


def attention_factor(rope: RopeConfig) -> float:
    """The magnitude scale YaRN applies to cos and sin (1 for the other types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq(rope, head_dim)[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor(rope)


apply_rope = rotate_half  # x: [T, heads, head_dim]; cos, sin: [T, head_dim // 2] (neox / rotate-half layout)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3), ... each rotated by one frequency. The output puts the
    rotated first members, then the second members (as transformers does): queries and keys get the same
    permutation, so their dot products are unchanged."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
