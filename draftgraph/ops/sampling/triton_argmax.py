"""Row argmax in Triton, in one or two stages: torch.argmax(-1)'s result, a few microseconds at a few rows.

One program per row (what Inductor's and ATen's argmax reductions do) leaves all but N SMs idle: at 1-5 rows
of a 128k vocabulary that costs ~30 us for a read whose floor is well under 1 us. Here each row is cut into
S chunks of `chunk` columns. Stage 1, grid (N, S): program (row, s) folds columns [s*chunk, (s+1)*chunk) into
(value, first index) in float32; stage 2, grid (N,): each row's S partials into the answer. With S = 1 stage 1
writes the answer itself (one launch). `choose_chunk` picks the chunk from host-known sizes only (rows,
vocabulary, SM count), nothing is read back to the host, and the scratch is allocated by the call, so the
launch can be captured in a CUDA graph.

Semantics are torch.argmax's exactly: the FIRST index of the maximum (-0.0 equals +0.0), and NaN counts as
larger than everything (the first NaN wins; ATen's `greater_or_nan`). A fold keeps its value unless the new
one is greater, or NaN over a non-NaN: each lane of a program sees increasing columns, and each lane of
stage 2 increasing splits, so equal values keep the earliest index; lanes are then merged by taking, among
the lanes holding the maximum (or a NaN, if any), the smallest index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import device_sm_count
from draftgraph.ops.launch import launch
from draftgraph.ops.sampling.op import SUPPORTED_DTYPES

STEP_BYTES = 8192  # bytes a stage-1 program loads per step at most (a program's loads are not overlapped
# across steps, so the bytes in flight per SM are programs per SM x this): 2048 float32 / 4096 16-bit columns
STAGE2_BLOCK = 1024  # partials per step of a stage-2 program
NONE_INDEX = 2**31 - 1  # the index of a lane that saw no column: larger than any real one, so never chosen
_NONE = tl.constexpr(NONE_INDEX)


@dataclass(frozen=True)
class ArgmaxRule:
    """How many columns each program folds. Aim the grid at `programs_per_sm` programs per SM (enough loads in
    flight to reach copy bandwidth; a launch in a graph costs ~2 us, a fold of 1k columns less). Rows alone
    reaching that many programs run one stage: splitting them would only add the second launch. Below it a
    row gets ceil(target / rows) chunks of at least `min_chunk` columns, rounded up to `align` columns
    (aligned vector loads). On an H100 (132 SMs, target 528) at V = 128256: 1 row -> 126 chunks of 1024,
    5 -> 101 of 1280, 32 -> 17 of 7680, 160 -> 4 of 32256, 528 rows and more -> one stage."""

    programs_per_sm: float = 4.0
    min_chunk: int = 1024
    align: int = 256

    def __post_init__(self):
        if self.programs_per_sm <= 0:
            raise ValueError(f"ArgmaxRule.programs_per_sm = {self.programs_per_sm} must be > 0")
        for name in ("min_chunk", "align"):
            if getattr(self, name) < 1:
                raise ValueError(f"ArgmaxRule.{name} = {getattr(self, name)} must be >= 1")


DEFAULT_ARGMAX_RULE = ArgmaxRule()


def choose_chunk(rows: int, vocab: int, sm_count: int | None, rule: ArgmaxRule | None = None) -> int:
    """Columns per stage-1 program; `vocab` (one stage) when splitting does not pay or the SM count is unknown
    (the interpreter checks correctness, not speed)."""
    rule = rule or DEFAULT_ARGMAX_RULE
    target = rule.programs_per_sm * (sm_count or 0)
    if rows == 0 or rows >= target:
        return max(vocab, 1)
    want = math.ceil(target / rows)
    chunk = max(rule.min_chunk, math.ceil(math.ceil(vocab / want) / rule.align) * rule.align)
    return min(chunk, max(vocab, 1))


@triton.jit
def _fold(acc_v, acc_i, x, idx, valid):
    """Lane-wise: take (x, idx) where it beats the lane's (value, index): greater, NaN over a number, or the
    lane's first column. Lanes see increasing indices, so an equal value keeps the earlier index."""
    take = valid & ((x > acc_v) | ((x != x) & (acc_v == acc_v)) | (acc_i == _NONE))
    return tl.where(take, x, acc_v), tl.where(take, idx, acc_i)


@triton.jit
def _merge(acc_v, acc_i):
    """Across lanes: (value, smallest index) among the lanes holding the maximum, or holding a NaN if any."""
    nan = acc_v != acc_v
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(nan, float("-inf"), acc_v), axis=0)
    hit = tl.where(any_nan, nan, acc_v == m)
    i = tl.min(tl.where(hit, acc_i, _NONE), axis=0)
    nan_value = tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(any_nan, nan_value, m), i


@triton.jit(do_not_specialize=["S"])  # S varies with the row count: one compiled variant for all of them
def _stage1(x_ptr, stride_row, stride_col, V, chunk, val_ptr, idx_ptr, out_ptr, S, ONE_STAGE: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    acc_v = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_i = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < hi
        x = tl.load(x_ptr + row * stride_row + cols.to(tl.int64) * stride_col, mask=valid, other=float("-inf"))
        acc_v, acc_i = _fold(acc_v, acc_i, x.to(tl.float32), cols, valid)
    finish_fold(acc_v, acc_i, row, split, val_ptr, idx_ptr, out_ptr, S, ONE_STAGE)


@triton.jit
def finish_fold(acc_v, acc_i, row, split, val_ptr, idx_ptr, out_ptr, S, ONE_STAGE: tl.constexpr):
    """The end of a stage-1 program: its lanes merged, then the row's answer (one stage) or this split's partial."""
    v, i = _merge(acc_v, acc_i)
    if ONE_STAGE:
        tl.store(out_ptr + row, i.to(tl.int64))
    else:
        tl.store(val_ptr + row * S + split, v)
        tl.store(idx_ptr + row * S + split, i)


@triton.jit(do_not_specialize=["S"])
def _stage2(val_ptr, idx_ptr, out_ptr, S, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_v = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_i = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(0, S, BLOCK):
        sp = start + tl.arange(0, BLOCK)
        valid = sp < S
        x = tl.load(val_ptr + row * S + sp, mask=valid, other=float("-inf"))
        idx = tl.load(idx_ptr + row * S + sp, mask=valid, other=_NONE)
        acc_v, acc_i = _fold(acc_v, acc_i, x, idx, valid & (idx != _NONE))  # an empty chunk offers nothing
    _, i = _merge(acc_v, acc_i)
    tl.store(out_ptr + row, i.to(tl.int64))


def argmax_triton(
    logits: torch.Tensor, chunk: int | None = None, block: int | None = None, rule: ArgmaxRule | None = None
) -> torch.Tensor:
    """logits [N, V] (float32 / bfloat16 / float16, any strides) -> [N] int64, the first index of each row's
    maximum (NaN above all). `chunk` (columns per stage-1 program) and `block` (columns per step: by default
    STEP_BYTES' worth, or the chunk rounded up to a power of two if smaller) override the rule: tests use small
    ones to put chunk and step boundaries inside short rows."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes logits [N, V]; got shape {tuple(logits.shape)}: reshape to 2 dims")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"argmax_rows takes {[str(d) for d in SUPPORTED_DTYPES]} logits; got {logits.dtype}: "
            "convert them, or use torch.argmax"
        )
    rows, vocab = logits.shape
    if vocab >= NONE_INDEX:
        raise ValueError(f"argmax_rows handles vocabularies below 2**31 - 1 columns; got {vocab}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows: logits has 0 columns, so rows have no argmax (as torch.argmax refuses)")
    if chunk is None:
        chunk = choose_chunk(rows, vocab, device_sm_count(logits.device), rule)
    if block is None:
        block = min(STEP_BYTES // logits.element_size(), triton.next_power_of_2(chunk))
    if chunk < 1 or block < 1 or block & (block - 1):
        raise ValueError(f"argmax_rows needs chunk >= 1 and a power-of-two block; got chunk {chunk}, block {block}")
    lead = (logits, logits.stride(0), logits.stride(1))
    return launch_folds(_stage1, lead, out, vocab, chunk, block, (rule or DEFAULT_ARGMAX_RULE).min_chunk)


def launch_folds(stage1, lead: tuple, out: torch.Tensor, vocab: int, chunk: int, block: int, min_chunk: int,
                 **constexprs) -> torch.Tensor:  # fmt: skip
    """Launch a stage-1 kernel whose arguments are `lead`, then (V, chunk, values, indices, out, S, ONE_STAGE,
    BLOCK, constexprs), over (rows, splits) of `chunk` columns, then stage 2 when a row has several splits;
    `out` [rows] int64 receives each row's first index of its maximum (the fold `_fold` / `finish_fold` define)."""
    rows = out.shape[0]
    splits = triton.cdiv(vocab, chunk)
    warps = min(8, max(1, block // 256))  # 8+ columns per thread: 16-byte loads of 16-bit types
    if splits == 1:
        launch(stage1, (rows, 1))(*lead, vocab, vocab, out, out, out, 1, ONE_STAGE=True, BLOCK=block,
                                  num_warps=warps, **constexprs)  # fmt: skip
        return out
    values = torch.empty(rows, splits, dtype=torch.float32, device=out.device)
    indices = torch.empty(rows, splits, dtype=torch.int32, device=out.device)
    launch(stage1, (rows, splits))(*lead, vocab, chunk, values, indices, out, splits, ONE_STAGE=False, BLOCK=block,
                                   num_warps=warps, **constexprs)  # fmt: skip
    # BLOCK from the vocabulary only (the most splits the rule gives), not from this call's splits: one
    # compiled stage-2 variant serves every row count (the loop covers more splits if a caller forces them)
    most = triton.cdiv(vocab, min_chunk)
    launch(_stage2, (rows,))(values, indices, out, splits, BLOCK=min(STAGE2_BLOCK, triton.next_power_of_2(most)),
                             num_warps=4)  # fmt: skip
    return out
