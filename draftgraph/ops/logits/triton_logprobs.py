"""The logprobs gather (logprobs.py) in three Triton launches: one read of the logits and a partial second one.

1. `_stats`, grid (N, S): program (row, s) loads `block` columns of the row and writes their maximum and their sum
   of exp(x - maximum).
2. `_top`, grid (N, S): the chunk's candidates for the row's top n, as int64 keys: the value's order-preserving
   int32 bits above, the column's complement below, so one integer maximum is the largest value at its lowest column
   (ties: lowest column first). The chunk maxima bound the work: a chunk below n others' maxima offers nothing (most
   chunks: nothing read), and every top value is at least the n-th largest chunk maximum, so a chunk offers only its
   values at or above it (one maximum-and-remove round each, at most n; typically one or two rounds, not n).
3. `_merge`, grid (N,): the row's log-sum-exp from its S partials, its top n from the S * n keys, the chosen
   token's logit, and the packed result (ids, then float64 bits of each value minus the log-sum-exp).

Values: exp and log are libdevice's on CUDA (torch's), but the sum runs in another order than torch.logsumexp's, so
logprobs agree to float32 rounding (~1e-6), not to the bit. The top list is exact (torch.topk leaves the order of
equal values open; here the lowest column comes first). Grids depend on N and V only (S from V); nothing is read
back to the host: the launches sit inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.launch import launch
from draftgraph.ops.triton_math import exp, log

STEP_BYTES = 8192  # bytes of logits a stage-1 program loads: 2048 float32 columns
_LOW = tl.constexpr(-(2**63))  # below every real key
_COLS = tl.constexpr(2**31 - 1)  # the column field holds _COLS - column (columns below 2**31 - 1)


@triton.jit
def _keys(x, cols):
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # -0.0 as +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (cols.to(tl.int64) * -1 + _COLS)  # (tensor first: the interpreter)


@triton.jit(do_not_specialize=["S"])
def _stats(x_ptr, stride_row, stride_col, V, m_ptr, s_ptr, S, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols.to(tl.int64) * stride_col, mask=cols < V, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(exp(x - tl.where(m == float("-inf"), 0.0, m), ACCURATE), axis=0)
    tl.store(m_ptr + row * S + split, m)
    tl.store(s_ptr + row * S + split, s)


@triton.jit(do_not_specialize=["S"])
def _top(x_ptr, stride_row, stride_col, V, m_ptr, key_ptr, S, N_TOP: tl.constexpr, TB: tl.constexpr,
         SB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    sp = tl.arange(0, SB)
    ms = tl.load(m_ptr + row * S + sp, mask=sp < S, other=float("-inf"))  # [SB] the row's chunk maxima
    mine = tl.load(m_ptr + row * S + split)
    found = tl.full([TB], _LOW, tl.int64)
    t_at = tl.arange(0, TB)
    # N_TOP chunks whose maxima all exceed this chunk's hold N_TOP values above each of its own: it offers none.
    if tl.sum((ms > mine).to(tl.int32), axis=0) < N_TOP:
        # Every top value is >= the N_TOP-th largest chunk maximum (those chunks hold N_TOP values >= it): the
        # smallest maximum of rank < N_TOP; with fewer than N_TOP chunks, no bound.
        rank = tl.sum((ms[None, :] > ms[:, None]).to(tl.int32), axis=1)  # [SB]
        bound = tl.min(tl.where((rank < N_TOP) & (sp < S), ms, float("inf")), axis=0)
        bound = tl.where(S < N_TOP, float("-inf"), bound)
        cols = split * BLOCK + tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(x_ptr + row * stride_row + cols.to(tl.int64) * stride_col, mask=valid, other=float("-inf"))
        x = x.to(tl.float32)
        keys = tl.where(valid, _keys(x, cols), _LOW)
        wanted = tl.minimum(tl.sum((valid & (x >= bound)).to(tl.int32), axis=0), N_TOP)
        for t in range(wanted):
            best = tl.max(keys, axis=0)
            found = tl.where(t_at == t, best, found)
            keys = tl.where(keys == best, _LOW, keys)
    tl.store(key_ptr + (row * S + split) * N_TOP + t_at, found, mask=t_at < N_TOP)


@triton.jit(do_not_specialize=["N"])
def _merge(x_ptr, stride_row, stride_col, chosen_ptr, m_ptr, s_ptr, key_ptr, out_ptr, N, S, N_TOP: tl.constexpr,
           SB: tl.constexpr, CB: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SB)
    ms = tl.load(m_ptr + row * S + sp, mask=sp < S, other=float("-inf"))
    ss = tl.load(s_ptr + row * S + sp, mask=sp < S, other=0.0)
    big = tl.max(ms, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)
    lse = big + log(tl.sum(ss * exp(ms - big, ACCURATE), axis=0), ACCURATE)
    c = tl.arange(0, CB)
    keys = tl.load(key_ptr + row * S * N_TOP + c, mask=c < S * N_TOP, other=_LOW)
    ch = tl.load(chosen_ptr + row).to(tl.int64)
    xc = tl.load(x_ptr + row * stride_row + ch * stride_col).to(tl.float32)
    vals = out_ptr + N * N_TOP + row * (N_TOP + 1)
    tl.store(vals, (xc - lse).to(tl.float64).to(tl.int64, bitcast=True))
    for t in tl.static_range(N_TOP):
        best = tl.max(keys, axis=0)
        keys = tl.where(keys == best, _LOW, keys)
        col = (best - ((best >> 32) << 32)) * -1 + _COLS  # from the low 32 bits
        ordered = (best >> 32).to(tl.int32)
        value = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
        tl.store(out_ptr + row * N_TOP + t, col)
        tl.store(vals + 1 + t, (value - lse).to(tl.float64).to(tl.int64, bitcast=True))


def gather_triton(logits: torch.Tensor, chosen: torch.Tensor, n: int, block: int | None = None) -> torch.Tensor:
    """logprobs.gather_reference's packed result (ids exact, values to float32 rounding); `block`: columns per
    stage-1 program (a power of two; tests use small ones)."""
    rows, vocab = logits.shape
    out = torch.empty(rows * (2 * n + 1), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if not 0 < n <= vocab or vocab >= 2**31 - 1:
        raise ValueError(f"logprobs gather: top {n} of {vocab} columns; need 0 < n <= V < 2**31 - 1")
    block = block or min(STEP_BYTES // logits.element_size(), triton.next_power_of_2(vocab))
    splits = triton.cdiv(vocab, block)
    dev, acc = logits.device, not triton_interpreting()
    m = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    s = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    keys = torch.empty(rows, splits, n, dtype=torch.int64, device=dev)
    lead = (logits, logits.stride(0), logits.stride(1))
    sb = triton.next_power_of_2(splits)
    launch(_stats, (rows, splits))(*lead, vocab, m, s, splits, BLOCK=block, ACCURATE=acc, num_warps=4)
    launch(_top, (rows, splits))(*lead, vocab, m, keys, splits, N_TOP=n, TB=triton.next_power_of_2(n), SB=sb,
                                 BLOCK=block, num_warps=4)  # fmt: skip
    launch(_merge, (rows,))(*lead, chosen, m, s, keys, out, rows, splits, N_TOP=n,
                            SB=sb, CB=triton.next_power_of_2(splits * n), ACCURATE=acc,
                            num_warps=4)  # fmt: skip
    return out
