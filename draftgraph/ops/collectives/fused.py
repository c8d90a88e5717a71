"""A one-row all-reduce fused into the GEMVs around it: no all-reduce launch of its own (OpChoices.fuse_all_reduce).

In a tensor-parallel decode step at batch 1 each all-reduce sits between a row-parallel GEMV (o_proj, down) and the
next add + RMSNorm fused into the next GEMV (qkv, gate_up: linear/triton_gemv.py's `_norm_gemv_kernel`, which
reads the whole row in every program). Here the lamport all-reduce (push.py) is split between the two:
- the writer, `_gemv_lamport_kernel` (the one-row GEMV, its epilogue): stores its output columns, -0.0 sent as
  +0.0, into every peer's row [slot][my rank][cols] of the fused region (push.py's PushLayout: fused2 / fused4),
  and the local partial y as the plain GEMV does;
- the reader, `_all_reduce_norm_gemv_kernel` (the norm GEMV): every program polls the peers' rows of the slot
  (volatile loads until no element is the sentinel -0.0), sums them with the local partial in rank order in
  float32 and rounds once (the lamport kernel's bits), adds the residual, RMS-norms and runs its columns; program
  0 writes the new residual, as today.

Three slots, not two: a reader cannot re-arm the rows it reads (its other programs may still be reading them), so
the reader of call e re-arms the rows of slot (e - 1) % 3 (call e - 1's, whose reader kernel has ended: the rows
of the width and length that call had, kept in `fused_state`) and the writer of call e writes slot e % 3. No peer
writes a slot before it is re-armed: a peer writes slot (e + 2) % 3 = (e - 1) % 3 only in its call e + 2,
whose writer runs after its reader of call e + 1 ended, which waited for this rank's call e + 1 data, sent by this
rank's writer e + 1 after this rank's reader e (which re-armed the slot) ended (stream order, kernel boundaries).
The epoch (`fused_state` [epoch, arrivals, last call's elements, its width]) is read by both kernels of a call at
their start and advanced by the reader's last program (an arrival counter), as push.py does; its region and state
are the fused pair's own, so the standalone kernels' slots and epoch never meet it. All ranks make the same calls
in the same order (SPMD).

The ops (`draftgraph::linear_send`, `draftgraph::all_reduce_add_rms_norm_linear`) fuse only one row (B = 1
decode) on a group whose peer all-reduce has a fused region; for more rows (rows are symbolic in a piecewise
graph) the writer is the plain linear and the reader the all_reduce op + add_rms_norm_linear, so one traced
graph serves every row count. Both are functional to the compiler (each output feeds the next op: nothing is
dead); their side effect is on the group's symmetric buffer and its epoch, as the all_reduce op's is, so a writer
must be followed by its reader before another fused writer of the group runs (the model's data flow orders it),
and every writer must have a reader: a partial summed another way (the model's last down projection, summed by a
plain all-reduce before the final norm) is the plain linear's, not sent (a sent row no reader consumes stays in its
slot, and the next reader of that slot reads it instead of waiting for the peer's).

The reader is a small kernel of its own by default (`FusedRule.reader` "kernel": `_lamport_read_kernel`, then the
ordinary norm GEMV, whose first weight chunk loads under PDL while the reader waits) or the norm GEMV itself
("gemv", above: one launch fewer, slower at the 8B's TP 2 shapes). The reader kernel re-arms the rows it read at
once (each element is read by one of its programs), and the rows an in-GEMV reader of the call before left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.collectives import op as _collectives  # noqa: F401  (the all_reduce op, the fallback's)
from draftgraph.ops.collectives.peer import peer_for
from draftgraph.ops.collectives.push import (
    ALIGN,
    PUSH_DTYPES,
    PushAllReduce,
    lamport_wait,
    send_to_peers,
    sentinel_block,
)
from draftgraph.ops.launch import launch, pdl_level
from draftgraph.ops.linear.op import check_linear, check_norm_linear
from draftgraph.ops.linear.triton_gemv import (
    GemvConfig,
    add_rms_norm_gemv_triton,
    choose_config,
    norm_rstd,
    normed_dot,
    row_gemv,
    store_columns,
)
from draftgraph.ops.registry import custom_op
from draftgraph.ops.triton_pdl import pdl_args, pdl_release, pdl_start

ARM = 256  # elements a reader program re-arms at once


@dataclass(frozen=True)
class FusedRule:
    """Where the fused pair's reader sums the row: "kernel", a small kernel of its own (`_lamport_read_kernel`: a
    program per 1024 elements) whose sum the ordinary add + RMSNorm + GEMV then reads (under PDL the GEMV's first
    weight chunk loads while it runs); "gemv", inside the norm GEMV (`_all_reduce_norm_gemv_kernel`: one launch
    fewer, but each of its programs polls and sums the whole row: 34 against 21.5 + 4.2 us a call unfused at the
    8B's TP 2 shapes on 2 x H200, docs/performance.md)."""

    reader: str = "kernel"

    def __post_init__(self):
        if self.reader not in ("kernel", "gemv"):
            raise ValueError(f"FusedRule.reader={self.reader!r}: 'kernel' or 'gemv' (ops/collectives/fused.py)")


FUSED_RULE = FusedRule()


@triton.jit
def _gemv_lamport_kernel(x, w, y, rows, deltas, state, N, K, swn, RANK: tl.constexpr, WORLD: tl.constexpr,
                         ROW: tl.constexpr, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SILU_MUL: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """`_gemv_kernel` (one row, no bias) whose epilogue also stores its columns into every peer's fused row
    [e % 3][RANK] (-0.0 as +0.0). PDL: as `_gemv_kernel`'s (ops/triton_pdl.py; the epoch is read after the wait)."""
    cols, col_ok, out = row_gemv(x, w, N, K, swn, BLOCK_N, BLOCK_K, SILU_MUL, ACCURATE, PDL)
    pdl_release(PDL)
    e = tl.load(state, cache_modifier=".cg") + 1
    slot = e % 3
    out = out.to(y.dtype.element_ty)
    tl.store(y + cols, out, mask=col_ok)
    send_to_peers(rows, deltas, cols, tl.where(out == 0, tl.zeros_like(out), out), col_ok, slot, RANK, WORLD, ROW, UNIT)


@triton.jit
def _rank_sum(x, rows, slot, idx, ok, acc, RANK: tl.constexpr, WORLD: tl.constexpr, ROW: tl.constexpr,
              WIDE: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    """acc plus the row at `idx` summed over the ranks in rank order (the lamport kernel's order and bits): this
    rank's partial x, each peer's from its fused row of `slot`. WAIT: polled until it holds no sentinel; else read
    (already seen whole: through L2)."""
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += tl.load(x + idx, mask=ok, other=0.0).to(tl.float32)
        else:
            ptrs = rows + (slot * WORLD + src) * ROW + idx
            if WAIT:
                v = lamport_wait(ptrs, ok, WIDE)
            else:
                v = tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
    return acc


@triton.jit
def _rearm_previous(rows2, rows4, state, e, pid, RANK: tl.constexpr, WORLD: tl.constexpr, ROW2: tl.constexpr,
                    ROW4: tl.constexpr, ARM_BLOCK: tl.constexpr):  # fmt: skip
    """The sentinel back into the rows of call e - 1 (slot (e - 1) % 3) that an in-GEMV reader left (their length and
    width in state[2:4]; 0: none), spread over this kernel's programs (`pid` of them)."""
    prev_n = tl.load(state + 2, cache_modifier=".cg")
    prev_wide = tl.load(state + 3, cache_modifier=".cg")
    prev = (e + 2) % 3
    step = tl.num_programs(0) * ARM_BLOCK
    for k0 in range(pid * ARM_BLOCK, prev_n, step):
        offs = k0 + tl.arange(0, ARM_BLOCK)
        m = offs < prev_n
        for src in tl.static_range(WORLD):
            if src != RANK:
                if prev_wide != 0:
                    tl.store(rows4 + (prev * WORLD + src) * ROW4 + offs,
                             tl.full([ARM_BLOCK], -2147483648, tl.int32), mask=m)  # fmt: skip
                else:
                    tl.store(rows2 + (prev * WORLD + src) * ROW2 + offs,
                             tl.full([ARM_BLOCK], -32768, tl.int16), mask=m)  # fmt: skip


@triton.jit
def _lamport_read_kernel(x, out, rows, rows2, rows4, state, n, chunk, RANK: tl.constexpr, WORLD: tl.constexpr,
                         ROW: tl.constexpr, ROW2: tl.constexpr, ROW4: tl.constexpr, BLOCK: tl.constexpr,
                         WIDE: tl.constexpr, ARM_BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The reader on its own (FusedRule.reader "kernel"): program pid sums elements [pid * chunk, + chunk) of the
    row over the ranks in rank order (this rank's partial x, the peers' from their fused rows of slot e % 3, polled),
    stores the sum and re-arms what it read (each element is read by one program only), and the rows an in-GEMV
    reader of the call before left; the last program ends the call (epoch e, no rows left for the next in-GEMV
    reader to re-arm). PDL: waits before any load."""
    pid = tl.program_id(0)
    pdl_start(PDL)
    e = tl.load(state, cache_modifier=".cg") + 1
    slot = e % 3
    dtype = x.dtype.element_ty
    sentinel = sentinel_block(x, BLOCK, WIDE)
    for off in range(pid * chunk, pid * chunk + chunk, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        ok = offs < n
        acc = _rank_sum(x, rows, slot, offs, ok, tl.zeros([BLOCK], dtype=tl.float32), RANK, WORLD, ROW, WIDE, True)
        tl.store(out + offs, acc.to(dtype), mask=ok)
        for src in tl.static_range(WORLD):
            if src != RANK:
                tl.store(rows + (slot * WORLD + src) * ROW + offs, sentinel, mask=ok)
    _rearm_previous(rows2, rows4, state, e, pid, RANK, WORLD, ROW2, ROW4, ARM_BLOCK)
    pdl_release(PDL)
    arrived = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state + 1, 0)
        tl.store(state + 2, 0)
        tl.store(state + 3, 0)
        tl.store(state, e)


@triton.jit
def _all_reduce_norm_gemv_kernel(x, r, nw, w, b, s_out, y, rows, rows2, rows4, state, N, K, swn, eps,
                                 RANK: tl.constexpr, WORLD: tl.constexpr, ROW: tl.constexpr, ROW2: tl.constexpr,
                                 ROW4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr,
                                 WHOLE: tl.constexpr, WIDE: tl.constexpr, ARM_BLOCK: tl.constexpr,
                                 ACCURATE: tl.constexpr):  # fmt: skip
    """`_norm_gemv_kernel` on (the sum of x over the ranks) + r: x is this rank's partial, the peers' come
    through the fused rows of slot e % 3 (polled); re-arms slot (e - 1) % 3's rows of the previous call."""
    pid = tl.program_id(0)
    dt = x.dtype.element_ty
    e = tl.load(state, cache_modifier=".cg") + 1
    slot = e % 3
    whole = tl.arange(0, WHOLE)
    in_row = whole < K
    # 1. wait for the peers' rows, sum in rank order (the lamport kernel's bits), the residual, the norm's rstd
    acc = _rank_sum(x, rows, slot, whole, in_row, tl.zeros([WHOLE], dtype=tl.float32), RANK, WORLD, ROW, WIDE, True)
    sv = (acc.to(dt).to(tl.float32) + tl.load(r + whole, mask=in_row, other=0.0).to(tl.float32)).to(dt)
    rstd = norm_rstd(sv, s_out, whole, in_row, K, eps, ACCURATE)
    # 2. this program's columns, the summed row remade chunk by chunk (the rows are there: read through L2)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    out = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w + cols.to(tl.int64)[:, None] * swn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = _rank_sum(x, rows, slot, kk, k_ok, tl.zeros([BLOCK_K], dtype=tl.float32), RANK, WORLD, ROW, WIDE, False)
        sk = (a.to(dt).to(tl.float32) + tl.load(r + kk, mask=k_ok, other=0.0).to(tl.float32)).to(dt)
        out = normed_dot(out, sk, rstd, nw, w_rows, kk, k_ok, col_ok)
    store_columns(tl.sum(out, axis=1), b, y, cols, col_ok, HAS_BIAS)
    # 3. re-arm the previous call's rows (its reader has ended), spread over this call's programs
    _rearm_previous(rows2, rows4, state, e, pid, RANK, WORLD, ROW2, ROW4, ARM_BLOCK)
    # 4. the last program here ends the call: the next call reads epoch e, this call's length and width
    arrived = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state + 1, 0)
        tl.store(state + 2, K)
        if WIDE:
            tl.store(state + 3, 1)
        else:
            tl.store(state + 3, 0)
        tl.store(state, e)


def fused_fits(push: PushAllReduce | None, x: torch.Tensor) -> bool:
    """Whether `push`'s fused region takes one row of x's width and dtype."""
    if push is None or not push.layout.fused_bytes or x.dtype not in PUSH_DTYPES:
        return False
    k = x.shape[-1]
    return x.numel() == k and 0 < k * x.element_size() <= push.layout.fused_bytes


def gemv_send_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    push: PushAllReduce,
    config: GemvConfig,
    silu_mul: bool = False,
    pdl: int = 0,
) -> torch.Tensor:
    """One row: y = x @ weight.T [1, N] (silu_mul: (silu(x[:K]) * x[K:]) @ weight.T), this rank's partial, also
    stored into every peer's fused row of this call's slot for `all_reduce_norm_gemv_triton` or `lamport_read_triton`
    to sum (`pdl`: the programmatic-dependent-launch level, ops/triton_pdl.py)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != (2 * k if silu_mul else k) or x.dtype != weight.dtype:
        raise ValueError(
            f"gemv_send_triton takes one row x [1, {'2K' if silu_mul else 'K'}] of weight [N, K]'s dtype; got "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if not fused_fits(push, y):
        raise ValueError(f"gemv_send_triton: a row of {n} {x.dtype} does not fit the fused region "
                         f"({push.layout.fused_bytes} bytes)")  # fmt: skip
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    size = x.element_size()
    launch(_gemv_lamport_kernel, (triton.cdiv(n, config.block_n),))(
        x, weight, y, push.fused[size].view(x.dtype), push.deltas, push.fused_state, n, k, weight.stride(0),
        RANK=push.rank, WORLD=push.layout.world_size, ROW=push.layout.fused_bytes // size, UNIT=ALIGN // size,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SILU_MUL=silu_mul, ACCURATE=not triton_interpreting(),
        num_warps=config.num_warps, **pdl_args(pdl),
    )  # fmt: skip
    return y


def lamport_read_triton(x: torch.Tensor, push: PushAllReduce, pdl: int = 0, block: int = 1024) -> torch.Tensor:
    """One row: the sum over the ranks of x (this rank's partial, the writer's y) [1, K], the peers' partials from
    the fused rows of this call's slot (`_lamport_read_kernel`; a program per `block` elements)."""
    if x.dim() != 2 or x.shape[0] != 1 or not fused_fits(push, x):
        raise ValueError(f"lamport_read_triton: one row [1, K] fitting the fused region ({push.layout.fused_bytes} "
                         f"bytes), got {tuple(x.shape)} {x.dtype}")  # fmt: skip
    x = x.contiguous()
    k, size = x.shape[1], x.element_size()
    out = torch.empty_like(x)
    programs, fb = triton.cdiv(k, block), push.layout.fused_bytes
    launch(_lamport_read_kernel, (programs,))(
        x, out, push.fused[size].view(x.dtype), push.fused[2].view(torch.int16), push.fused[4].view(torch.int32),
        push.fused_state, k, block, RANK=push.rank, WORLD=push.layout.world_size, ROW=fb // size, ROW2=fb // 2,
        ROW4=fb // 4, BLOCK=block, WIDE=size == 4, ARM_BLOCK=ARM, num_warps=4, **pdl_args(pdl),
    )  # fmt: skip
    return out


def all_reduce_norm_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    push: PushAllReduce,
    config: GemvConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (s, y) with s = sum over the ranks of x (this rank's partial, the writer's y) + residual and
    y = rms_norm(s) @ weight.T (+ bias), one launch; the peers' partials from the fused rows."""
    check_norm_linear("all_reduce_norm_gemv_triton", x, residual, norm_weight, weight, rows="1")
    if not fused_fits(push, x):
        raise ValueError(f"all_reduce_norm_gemv_triton: a row of {x.shape[-1]} {x.dtype} does not fit the fused "
                         f"region ({push.layout.fused_bytes} bytes)")  # fmt: skip
    k, n = x.shape[-1], weight.shape[0]
    x, residual, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual, weight))
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    size = x.element_size()
    fb = push.layout.fused_bytes
    launch(_all_reduce_norm_gemv_kernel, (max(triton.cdiv(n, config.block_n), 1),))(
        x, residual, norm_weight, weight, bias if bias is not None else weight, s, y, push.fused[size].view(x.dtype),
        push.fused[2].view(torch.int16), push.fused[4].view(torch.int32), push.fused_state, n, k, weight.stride(0),
        eps, RANK=push.rank, WORLD=push.layout.world_size, ROW=fb // size, ROW2=fb // 2, ROW4=fb // 4,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, WHOLE=triton.next_power_of_2(k), WIDE=size == 4,
        ARM_BLOCK=ARM, ACCURATE=not triton_interpreting(), num_warps=config.num_warps,
    )  # fmt: skip
    return s, y


def _fused_push(row: torch.Tensor, group_name: str, count: bool = False) -> PushAllReduce | None:
    """The group's push state when this call fuses: `row` (the all-reduced message, or one of its shape) one row
    on the symmetric buffer's device, fitting the fused region; None otherwise (writer and reader decide alike:
    the same row, width, dtype and group). At one row the fused pair runs the Triton GEMVs whatever the dtype
    (float32 too, which the unfused ops give to cuBLAS). `count`: the reader's call, counted in the peer's
    `calls["fused"]`."""
    if not group_name or not row.is_cuda:
        return None
    peer = peer_for(group_name)
    push = getattr(peer, "push", None)
    if push is None or row.device != peer.buffer.device or not fused_fits(push, row):
        return None
    if count:
        peer.calls["fused"] = peer.calls.get("fused", 0) + 1
    return push


@custom_op("draftgraph::linear_send", mutates_args=())
def linear_send(x: torch.Tensor, weight: torch.Tensor, group_name: str, silu_mul: bool) -> torch.Tensor:
    """A row-parallel projection's local partial x @ weight.T (silu_mul: of silu(gate) * up, x = gate | up),
    which `all_reduce_add_rms_norm_linear` sums over the group. One row on a group with a fused region: the GEMV
    also stores it into the peers' fused rows (a side effect on the symmetric buffer); otherwise the plain op."""
    out_shape = (*x.shape[:-1], weight.shape[0])
    one_row = x.numel() == x.shape[-1]
    push = _fused_push(x.new_empty((1, weight.shape[0])), group_name) if one_row and x.is_cuda else None
    if push is None:
        if silu_mul:
            return torch.ops.draftgraph.silu_mul_linear(x, weight, None)
        return torch.ops.draftgraph.linear(x, weight, None)
    flat = x.reshape(1, x.shape[-1])
    config = choose_config(1, weight.shape[1], silu_mul=silu_mul)
    return gemv_send_triton(flat, weight, push, config, silu_mul, pdl_level(x.device)).view(out_shape)


@linear_send.register_fake
def _(x, weight, group_name, silu_mul):
    check_linear("linear_send", x, weight, silu_mul=silu_mul)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op("draftgraph::all_reduce_add_rms_norm_linear", mutates_args=())
def all_reduce_add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_linear(all_reduce(x), residual, ...), x a `linear_send` output: one row on a group with a
    fused region is one launch (the sum read from the peers' fused rows, then re-armed: a side effect on the
    symmetric buffer); otherwise the all_reduce op then add_rms_norm_linear."""
    push = _fused_push(x, group_name, count=True)
    if push is None:
        summed = torch.ops.draftgraph.all_reduce(x, group_name)
        return torch.ops.draftgraph.add_rms_norm_linear(summed, residual, norm_weight, eps, weight, bias)
    k = x.shape[-1]
    if FUSED_RULE.reader == "kernel":  # (the Triton norm GEMV whatever the dtype, as the in-GEMV reader: its bits)
        pdl = pdl_level(x.device)
        summed = lamport_read_triton(x.reshape(1, k), push, pdl)
        config = choose_config(1, k, norm=True)
        s, y = add_rms_norm_gemv_triton(summed, residual.reshape(1, k), norm_weight, eps, weight, bias, config, pdl)
        return s.view(x.shape), y.view(*x.shape[:-1], weight.shape[0])
    s, y = all_reduce_norm_gemv_triton(
        x.reshape(1, k), residual.reshape(1, k), norm_weight, eps, weight, bias, push, choose_config(1, k, norm=True)
    )
    return s.view(x.shape), y.view(*x.shape[:-1], weight.shape[0])


@all_reduce_add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias, group_name):
    check_norm_linear("all_reduce_add_rms_norm_linear", x, residual, norm_weight, weight)
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], weight.shape[0]))
