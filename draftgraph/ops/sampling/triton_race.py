"""The exponential race (noise.race_reference) in Triton: the hashed noise made in registers, no [N, V] tensors.

race_reference builds the noise of every (row, column) as int64 hash steps and float32 uniforms: several
[N, V] temporaries (8 bytes an entry for the hash), which a captured sampled step keeps in its graph pool, and a
dozen elementwise launches. Here stage 1, grid (N, S) as triton_argmax's, hashes each column's uniform in uint32
registers (the same bits as noise._mix32 on int64), computes p / -log(u) and folds (value, first index); stage 2
is triton_argmax's. The same chunk rule (`choose_chunk`) spreads a few rows over the SMs.

On CUDA the race's values are computed as torch's kernels compute them (libdevice's logf, IEEE division), so
the tokens are race_reference's; under the Triton interpreter (no libdevice) log may differ in its last bit,
which could only flip a tie between two columns' values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops import triton_math
from draftgraph.ops.backends import device_sm_count, triton_interpreting
from draftgraph.ops.sampling.noise import COLUMN_MULT, UNIFORM_SCALE, UNIFORM_SHIFT
from draftgraph.ops.sampling.triton_argmax import (
    _NONE,
    DEFAULT_ARGMAX_RULE,
    STEP_BYTES,
    _fold,
    choose_chunk,
    finish_fold,
    launch_folds,
)

_COLUMN_MULT = tl.constexpr(COLUMN_MULT)
_UNIFORM_SCALE = tl.constexpr(UNIFORM_SCALE)
_UNIFORM_SHIFT = tl.constexpr(UNIFORM_SHIFT)


@triton.jit
def _mix32(x):
    """noise._mix32 on uint32 (products wrap mod 2^32, as the int64 version's masks do)."""
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x68E31DA5
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["S", "salt"])
def _race_stage1(p_ptr, stride_row, seeds_ptr, pos_ptr, salt, V, chunk, val_ptr, idx_ptr, out_ptr, S,
                 ONE_STAGE: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    salt32 = salt.to(tl.uint32)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    pos = tl.load(pos_ptr + row).to(tl.uint32)
    base = _mix32(_mix32(seed ^ salt32) + pos)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    acc_v = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_i = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < hi
        col_hash = _mix32(cols.to(tl.uint32) * _COLUMN_MULT + salt32)
        h = _mix32(base ^ col_hash)
        u = ((h >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
        p = tl.load(p_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
        # IEEE division and libdevice's logf, as torch's elementwise kernels compute p / -log(u)
        acc_v, acc_i = _fold(acc_v, acc_i, tl.math.div_rn(p, -triton_math.log(u, ACCURATE)), cols, valid)
    finish_fold(acc_v, acc_i, row, split, val_ptr, idx_ptr, out_ptr, S, ONE_STAGE)


def race_triton(
    probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    salt: int,
    chunk: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """probs [N, V] float32 (rows contiguous), seeds [N], positions [N] -> [N] int64 tokens, as race_reference.
    `chunk` / `block` override the split rule (tests put chunk and step boundaries inside short rows)."""
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"race_sample takes float32 probs [N, V]; got {probs.dtype} {tuple(probs.shape)}")
    rows, vocab = probs.shape
    if seeds.shape != (rows,) or positions.shape != (rows,):
        raise ValueError(
            f"race_sample needs one seed and one position per row: probs has {rows} rows, seeds "
            f"{tuple(seeds.shape)}, positions {tuple(positions.shape)}"
        )
    if not 0 <= salt < 2**32:
        raise ValueError(f"race_sample's salt must be a 32-bit value; got {salt}")
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    if chunk is None:
        chunk = choose_chunk(rows, vocab, device_sm_count(probs.device))
    if block is None:
        block = min(STEP_BYTES // 4, triton.next_power_of_2(chunk))
    seeds, positions = seeds.contiguous(), positions.contiguous()
    lead = (probs, probs.stride(0), seeds, positions, salt)
    return launch_folds(
        _race_stage1, lead, out, vocab, chunk, block, DEFAULT_ARGMAX_RULE.min_chunk, ACCURATE=not triton_interpreting()
    )
