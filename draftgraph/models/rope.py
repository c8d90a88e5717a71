"""Rotary position embedding: inverse frequencies (default, linear, llama3) and the cos/sin table."""

from __future__ import annotations

import math

import torch

from draftgraph.models.config import RopeConfig


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
    return freqs


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq(rope, head_dim)[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim // 2] (neox / rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
