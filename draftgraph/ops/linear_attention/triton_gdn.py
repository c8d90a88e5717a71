"""Triton kernels for `torch.ops.draftgraph.gated_delta_net` (op.py holds the contract) and their launch.

Two kernels per layer and forward, grids from host-known sizes only (tokens, requests, heads), no host read:
1. `_conv_kernel`, one program per (tile of BT tokens, tile of BC channels): the short causal conv over the
   run's own inputs and the conv ring's older ones, then SiLU, into a [T, C] buffer (x's dtype). It only
   READS the conv ring.
2. `_recurrent_kernel`, one program per (request, v head, block of BV value columns): loads the state tile
   [Dk, BV] at ring entry (p0 - 1) % L (zeros at position 0), runs the gated delta rule token by token over
   the request's run (q, k l2-normalised in the kernel), writes each token's output and the state after each
   of the run's last min(n, L) positions to ring entry p % L. It also writes the run's last min(n, Lc) conv
   inputs into the conv ring (the request's channels split across its programs): kernel 1 has finished
   reading the ring by then (stream order), so no program can overwrite history another still needs.
Every program owns its state tile in every ring entry, so reading the entry before the run and writing the
entries after its positions never races. Padding (token_kv_len 0, empty runs) reads and writes nothing.

Decode, verify and draft-model steps are exactly this (the case inside FULL graphs). A long run is correct
too, token by token; outside graph captures chunked.py sends long runs' heads to fla's chunked kernel first
and this kernel then starts such a run at `skip` (the head's final state already in the ring).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests/test_linear_attention_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import device_sm_count
from draftgraph.ops.launch import launch

CONV_BLOCK_T, CONV_BLOCK_C = 16, 128
COUNT_BLOCK = 16  # tokens read at a time when counting a run's valid tokens


@triton.jit(do_not_specialize=["T", "B"])  # tokens and requests: one compiled variant for every batch
def _conv_kernel(
    x_ptr, w_ptr, ring_ptr, out_ptr, rows_ptr, qsl_ptr, req_ptr, kvlen_ptr,
    T, C, B, stride_x, stride_ring_r, stride_ring_p, stride_out,
    LC: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    kv = tl.load(kvlen_ptr + t, mask=tm, other=0)
    valid = tm & (kv > 0)
    r = tl.minimum(tl.maximum(tl.load(req_ptr + t, mask=tm, other=0), 0), B - 1)
    off = t - tl.load(qsl_ptr + r, mask=valid, other=0)  # offset inside the run
    pos = kv - 1
    row = tl.load(rows_ptr + r, mask=valid, other=0).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        back = W - 1 - j  # tap j reads the input `back` positions before the token
        wj = tl.load(w_ptr + c * W + j, mask=cm, other=0.0).to(tl.float32)
        in_run = off >= back
        in_ring = (~in_run) & (pos >= back)
        src = tl.where(in_run, t - back, 0).to(tl.int64)
        xv = tl.load(x_ptr + src[:, None] * stride_x + c[None, :], mask=(valid & in_run)[:, None] & cm[None, :],
                     other=0.0)  # fmt: skip
        col = tl.where(in_ring, (pos - back) % LC, 0).to(tl.int64)
        rv = tl.load(ring_ptr + row[:, None] * stride_ring_r + col[:, None] * stride_ring_p + c[None, :],
                     mask=(valid & in_ring)[:, None] & cm[None, :], other=0.0)  # fmt: skip
        acc += (xv.to(tl.float32) + rv.to(tl.float32)) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])  # fmt: skip


@triton.jit
def _recurrent_kernel(
    conv_ptr, g_ptr, beta_ptr, x_ptr, conv_ring_ptr, ssm_ptr, out_ptr, rows_ptr, qsl_ptr, kvlen_ptr, skip_ptr,
    C, scale, stride_conv, stride_g, stride_beta, stride_x, stride_cr_r, stride_cr_p,
    stride_s_r, stride_s_p, stride_s_h, stride_out_t, stride_out_h,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, L: tl.constexpr, LC: tl.constexpr, CH: tl.constexpr,
    CH_PAD: tl.constexpr, HAS_SKIP: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    pid = tl.program_id(1)
    hv, vb = pid // NV, pid % NV
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    n = start - start  # the run's valid tokens (they come first in its rows)
    for s in range(start, end, CB):
        idx = s + tl.arange(0, CB)
        n += tl.sum((tl.load(kvlen_ptr + idx, mask=idx < end, other=0) > 0).to(tl.int32))
    if n > 0:
        p0 = tl.load(kvlen_ptr + start) - 1
        row = tl.load(rows_ptr + b).to(tl.int64)
        # The conv ring: inputs of the run's last min(n, Lc) positions, this program's share of the channels.
        ch = pid * CH + tl.arange(0, CH_PAD)
        chm = (tl.arange(0, CH_PAD) < CH) & (ch < C)
        for j in tl.static_range(LC):
            w_off = n - LC + j  # the written input's offset in the run (names unique: `o` is the loop's output)
            oc = tl.maximum(w_off, 0)
            ok = (ch * 0 + w_off) >= 0  # as a vector: the interpreter masks with tensors only
            xv = tl.load(x_ptr + (start + oc).to(tl.int64) * stride_x + ch, mask=chm & ok, other=0.0)
            dst = conv_ring_ptr + row * stride_cr_r + ((p0 + oc) % LC) * stride_cr_p + ch
            tl.store(dst, xv.to(conv_ring_ptr.dtype.element_ty), mask=chm & ok)
        # The recurrence over this v head's columns [vb * BV, vb * BV + BV).
        first = 0
        if HAS_SKIP:
            first = tl.load(skip_ptr + b)
        hk = hv // GROUP
        dk = tl.arange(0, DK_PAD)
        dv = vb * BV + tl.arange(0, BV)
        dkm, dvm = dk < DK, dv < DV
        tile = dk[:, None] * DV + dv[None, :]  # a state is [Dk, Dv], contiguous
        tmask = dkm[:, None] & dvm[None, :]
        head = ssm_ptr + row * stride_s_r + hv * stride_s_h
        ps = p0 + first
        prev = tl.where(ps > 0, (ps - 1) % L, 0)
        h = tl.load(head + prev * stride_s_p + tile, mask=tmask & ((tile * 0 + ps) > 0), other=0.0).to(tl.float32)
        for i in range(first, n):
            t = (start + i).to(tl.int64)
            base = conv_ptr + t * stride_conv
            q = tl.load(base + hk * DK + dk, mask=dkm, other=0.0).to(tl.float32)
            k = tl.load(base + (HK + hk) * DK + dk, mask=dkm, other=0.0).to(tl.float32)
            v = tl.load(base + 2 * HK * DK + hv * DV + dv, mask=dvm, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k) + 1e-6))
            decay = tl.exp(tl.load(g_ptr + t * stride_g + hv).to(tl.float32))
            beta = tl.load(beta_ptr + t * stride_beta + hv).to(tl.float32)
            h = h * decay
            delta = (v - tl.sum(h * k[:, None], 0)) * beta  # [BV]
            h = h + k[:, None] * delta[None, :]
            o = tl.sum(h * q[:, None], 0)
            tl.store(out_ptr + t * stride_out_t + hv * stride_out_h + dv, o.to(out_ptr.dtype.element_ty), mask=dvm)
            tl.store(head + ((p0 + i) % L) * stride_s_p + tile, h, mask=tmask & ((tile * 0 + i) >= n - L))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def conv_forward(x, conv_weight, conv_states, rows, query_start_loc, token_req, token_kv_len) -> torch.Tensor:
    """Kernel 1: SiLU(causal conv) of every token, [T, C] in x's dtype (padding tokens: zeros)."""
    t, c = x.shape
    out = torch.empty_like(x)
    grid = (triton.cdiv(t, CONV_BLOCK_T), triton.cdiv(c, CONV_BLOCK_C))
    launch(_conv_kernel, grid)(
        x, conv_weight, conv_states, out, rows, query_start_loc, token_req, token_kv_len,
        t, c, rows.shape[0], x.stride(0), conv_states.stride(0), conv_states.stride(1), out.stride(0),
        LC=conv_states.shape[1], W=conv_weight.shape[1], BT=CONV_BLOCK_T, BC=CONV_BLOCK_C, num_warps=4,
    )  # fmt: skip
    return out


def value_block(num_reqs: int, num_v_heads: int, head_v_dim: int, device: torch.device) -> int:
    """Value columns per program: 32, halved (down to 8) while the grid would leave SMs idle."""
    bv = min(32, _pow2(head_v_dim))
    sms = device_sm_count(device)
    while sms and bv > 8 and num_reqs * num_v_heads * triton.cdiv(head_v_dim, bv) < sms:
        bv //= 2
    return bv


def recurrent_forward(conv, g, beta, x, conv_states, ssm_states, rows, query_start_loc, token_kv_len, out,
                      skip: torch.Tensor | None = None) -> None:  # fmt: skip
    """Kernel 2: the recurrence over every run (from `skip[b]` on where given), writing `out` and the rings."""
    b = rows.shape[0]
    _, ring, hv, dk, dv = ssm_states.shape
    hk = (x.shape[1] - hv * dv) // (2 * dk)
    bv = value_block(b, hv, dv, x.device)
    nv = triton.cdiv(dv, bv)
    ch = triton.cdiv(x.shape[1], hv * nv)
    assert ssm_states.stride(4) == 1 and ssm_states.stride(3) == dv, "each state must be contiguous"
    launch(_recurrent_kernel, (b, hv * nv))(
        conv, g, beta, x, conv_states, ssm_states, out, rows, query_start_loc, token_kv_len,
        rows if skip is None else skip,
        x.shape[1], dk**-0.5, conv.stride(0), g.stride(0), beta.stride(0), x.stride(0),
        conv_states.stride(0), conv_states.stride(1), ssm_states.stride(0), ssm_states.stride(1),
        ssm_states.stride(2), out.stride(0), out.stride(1),
        HK=hk, GROUP=hv // hk, DK=dk, DV=dv, DK_PAD=_pow2(dk), BV=bv, NV=nv, L=ring, LC=conv_states.shape[1],
        CH=ch, CH_PAD=_pow2(ch), HAS_SKIP=skip is not None, CB=COUNT_BLOCK, num_warps=4,
    )  # fmt: skip


def gated_delta_net_triton(
    x, g, beta, conv_weight, conv_states, ssm_states, req_rows, query_start_loc, token_req, token_kv_len,
    chunk_fn="auto", min_run: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The op on CUDA (or the interpreter). `chunk_fn`: "auto" uses fla for long runs' heads where it imports
    and suits the dims (chunked.py), None never, or a function of fla's signature (tests); `min_run`: the
    shortest run sent there (chunked.CHUNK_MIN_RUN)."""
    from draftgraph.ops.linear_attention import chunked

    num_tokens, b = x.shape[0], req_rows.shape[0]
    _, ring, hv, dk, dv = ssm_states.shape
    out = x.new_zeros(num_tokens, hv, dv)
    if num_tokens == 0 or b == 0:
        return out
    x, g, beta, conv_weight = x.contiguous(), g.contiguous(), beta.contiguous(), conv_weight.contiguous()
    conv = conv_forward(x, conv_weight, conv_states, req_rows, query_start_loc, token_req, token_kv_len)
    if chunk_fn == "auto":
        chunk_fn = chunked.fla_chunk_fn() if x.device.type == "cuda" and chunked.fla_suits(dk, dv) else None
    plan = None
    if chunk_fn is not None:
        min_run = chunked.CHUNK_MIN_RUN if min_run is None else min_run
        plan = chunked.maybe_plan(query_start_loc, token_kv_len, num_tokens, ring, min_run)
    if plan is not None:
        hk = (x.shape[1] - hv * dv) // (2 * dk)
        chunked.run_heads(plan, chunk_fn, conv, g, beta, ssm_states, req_rows, out, hk)
    recurrent_forward(conv, g, beta, x, conv_states, ssm_states, req_rows, query_start_loc, token_kv_len, out,
                      None if plan is None else plan.skip)  # fmt: skip
    return out
