"""Counter-based noise for token choice: uniforms hashed from (request seed, token position, purpose, column),
and the exponential race that draws a token with them. No generator state: the same request and position
draw the same noise whatever the batch around them, nothing syncs with the host, and the code can sit inside
a captured graph.

The hash is a 32-bit integer finalizer (`_mix32`); here on int64 tensors holding values below 2^32 (every
product stays below 2^63), in Triton on uint32 (triton_race.py), with the same bits.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
COLUMN_MULT = 0x3C6EF373  # a column's hash input: column * COLUMN_MULT + salt
# A uniform: ((hash >> UNIFORM_SHIFT) + 0.5) * UNIFORM_SCALE, 2^23 values in [2^-24, 1 - 2^-24], each exact in float32.
# (24 bits would round the largest, 1 - 2^-25, up to 1.0: -log(u) = -0.0, and p / -0.0 is -inf to torch but +inf
# where the negation is a subtraction from zero, as Triton's is: the race's tokens would differ.)
UNIFORM_SHIFT = 9
UNIFORM_SCALE = 1.0 / (1 << (32 - UNIFORM_SHIFT))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values in [0, 2^32); products stay < 2^63."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & _MASK
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int = 0) -> torch.Tensor:
    """Uniforms in (0, 1), float32: [N] when width == 0, else [N, width] (one per vocabulary entry)."""
    base = _mix32(_mix32(seeds.long() ^ salt) + positions.long())  # [N]
    if width:
        cols = _mix32(torch.arange(width, device=seeds.device, dtype=torch.long) * COLUMN_MULT + salt)
        base = _mix32(base[:, None] ^ cols[None, :])  # [N, width]
    return ((base >> UNIFORM_SHIFT).float() + 0.5) * UNIFORM_SCALE


def race_reference(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One token per row of probs [N, V] by the exponential race: argmax_v p_v / E_v with E_v = -log(u_v) ~ Exp(1),
    which draws v with probability p_v exactly. Builds [N, V] noise (int64 hash steps, then float32)."""
    u = uniform_noise(seeds, positions, salt, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(-1)
