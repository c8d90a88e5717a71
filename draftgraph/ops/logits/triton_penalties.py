"""The logits processing of penalties.py in two Triton launches: one read and one write of the logits.

1. `_dense`, grid (B, V / BLOCK): program (b, block) loads the slot's counts and flags of its columns once and
   processes that block of each of the request's R rows with them (bias 0, the slot's counts; too_early per row),
   or copies the rows unchanged when the slot is inactive (bit for bit).
2. `_columns`, grid (B,): the only entries the dense pass got wrong, processed again from the raw logits: the
   bias columns (ids are distinct: SamplingParams refuses repeats; zero biases and padding pairs are skipped) and
   the K draft columns, each with row i's counts there (the slot's plus the drafts before row i equal to it) and
   its bias.
   A column that is both, or drafted twice, is written with the same value by every write.

Values equal the torch ops' to the bit on CUDA: the division is IEEE (`div_rn`; Triton's `/` is approximate) and
the launch turns off multiply-add contraction (`enable_fp_fusion=False`), as ATen runs each op apart. Grids depend
on B and V only and nothing is read back to the host: both launches sit inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import launch
from draftgraph.ops.logits.penalties import PROMPT, STOP, PenaltyTables

BLOCK = 1024  # columns per dense program (4 KB of float32 per row)
_PROMPT, _STOP = tl.constexpr(PROMPT), tl.constexpr(STOP)


@triton.jit
def _penalized(x, bias, cnt, flag, too_early, rep, freq, pres):
    """penalties._processed on float32 x with its columns' bias, counts (int32) and flags (int32)."""
    x = x + bias
    x = tl.where(too_early & ((flag & _STOP) != 0), float("-inf"), x)
    seen = (cnt > 0) | ((flag & _PROMPT) != 0)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    x = x - freq * cnt.to(tl.float32)
    return x - pres * (cnt > 0).to(tl.float32)


@triton.jit(do_not_specialize=["FIRST"])  # a draft step's index: one compiled variant for all of them
def _dense(x_ptr, sx_b, sx_r, sx_v, out_ptr, slots_ptr, counts_ptr, flags_ptr, rep_ptr, freq_ptr, pres_ptr,
           min_ptr, gen_ptr, active_ptr, V, R, FIRST, BLOCK: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    slot = tl.load(slots_ptr + b).to(tl.int64)
    src = x_ptr + b * sx_b + cols.to(tl.int64) * sx_v
    dst = out_ptr + b * R * V + cols
    if tl.load(active_ptr + slot) != 0:
        cnt = tl.load(counts_ptr + slot * V + cols, mask=valid, other=0)
        flag = tl.load(flags_ptr + slot * V + cols, mask=valid, other=0).to(tl.int32)
        rep, freq, pres = tl.load(rep_ptr + slot), tl.load(freq_ptr + slot), tl.load(pres_ptr + slot)
        gen, least = tl.load(gen_ptr + slot) + FIRST, tl.load(min_ptr + slot)
        for i in range(R):
            x = tl.load(src + i * sx_r, mask=valid, other=0.0).to(tl.float32)
            y = _penalized(x, 0.0, cnt, flag, gen + i < least, rep, freq, pres)
            tl.store(dst + i * V, y.to(out_ptr.dtype.element_ty), mask=valid)
    else:
        for i in range(R):
            tl.store(dst + i * V, tl.load(src + i * sx_r, mask=valid, other=0.0), mask=valid)


@triton.jit(do_not_specialize=["K", "FIRST"])
def _columns(x_ptr, sx_b, sx_r, sx_v, out_ptr, slots_ptr, drafts_ptr, sd_b, sd_k, K, counts_ptr, flags_ptr, rep_ptr,
             freq_ptr, pres_ptr, min_ptr, gen_ptr, active_ptr, ids_ptr, vals_ptr, NB, V, R, FIRST, KB: tl.constexpr,
             BB: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if tl.load(active_ptr + slot) != 0:
        rep, freq, pres = tl.load(rep_ptr + slot), tl.load(freq_ptr + slot), tl.load(pres_ptr + slot)
        gen, least = tl.load(gen_ptr + slot), tl.load(min_ptr + slot)
        j = tl.arange(0, KB)
        in_k = j < K
        d = tl.load(drafts_ptr + b * sd_b + j * sd_k, mask=in_k, other=-1).to(tl.int64)  # [KB] draft columns
        p = tl.arange(0, BB)
        vals = tl.load(vals_ptr + slot * NB + p, mask=p < NB, other=0.0)
        ids = tl.load(ids_ptr + slot * NB + p, mask=p < NB, other=-1).to(tl.int64)
        ids = tl.where(vals != 0.0, ids, -1)  # [BB] bias columns; padding pairs and zero biases change nothing
        d_bias = tl.sum(tl.where(d[:, None] == ids[None, :], vals[None, :], 0.0), axis=1)  # [KB]
        dc, bc = tl.where(in_k, d, 0), tl.where(ids >= 0, ids, 0)
        d_cnt = tl.load(counts_ptr + slot * V + dc, mask=in_k, other=0)
        d_flag = tl.load(flags_ptr + slot * V + dc, mask=in_k, other=0).to(tl.int32)
        b_cnt = tl.load(counts_ptr + slot * V + bc, mask=ids >= 0, other=0)
        b_flag = tl.load(flags_ptr + slot * V + bc, mask=ids >= 0, other=0).to(tl.int32)
        src = x_ptr + b * sx_b
        dst = out_ptr + b * R * V
        for i in range(R):
            before = in_k & (j < FIRST + i)  # the drafts before row i
            d_extra = tl.sum(((d[:, None] == d[None, :]) & before[None, :]).to(tl.int32), axis=1)
            b_extra = tl.sum(((ids[:, None] == d[None, :]) & before[None, :]).to(tl.int32), axis=1)
            too_early = gen + FIRST + i < least
            x = tl.load(src + i * sx_r + dc * sx_v, mask=in_k, other=0.0).to(tl.float32)
            y = _penalized(x, d_bias, d_cnt + d_extra, d_flag, too_early, rep, freq, pres)
            tl.store(dst + i * V + dc, y.to(out_ptr.dtype.element_ty), mask=in_k)
            x = tl.load(src + i * sx_r + bc * sx_v, mask=ids >= 0, other=0.0).to(tl.float32)
            y = _penalized(x, vals, b_cnt + b_extra, b_flag, too_early, rep, freq, pres)
            tl.store(dst + i * V + bc, y.to(out_ptr.dtype.element_ty), mask=ids >= 0)


def process_triton(
    logits: torch.Tensor,
    slots: torch.Tensor,
    drafts: torch.Tensor | None,
    t: PenaltyTables,
    first_row: int = 0,
    block: int = BLOCK,
) -> torch.Tensor:
    """penalties.process_reference's result by the two launches (module docstring); `block`: columns per dense
    program (tests use small ones)."""
    b, r, v = logits.shape
    out = torch.empty(b, r, v, dtype=logits.dtype, device=logits.device)
    if b == 0 or v == 0:
        return out
    k = drafts.shape[1] if drafts is not None else 0
    d = drafts if k else slots.view(-1, 1)  # never read when k = 0
    sx = logits.stride()
    tables = (t.counts, t.flags, t.repetition, t.frequency, t.presence, t.min_tokens, t.generated, t.active)
    launch(_dense, (b, triton.cdiv(v, block)))(logits, *sx, out, slots, *tables, v, r, first_row, BLOCK=block,
                                               enable_fp_fusion=False)  # fmt: skip
    nb = t.bias_ids.shape[1]
    columns = (t.bias_ids, t.bias_vals, nb, v, r, first_row)
    launch(_columns, (b,))(logits, *sx, out, slots, d, *d.stride(), k, *tables, *columns,
                           KB=max(triton.next_power_of_2(k), 2), BB=triton.next_power_of_2(max(nb, 2)),
                           enable_fp_fusion=False)  # fmt: skip
    return out
