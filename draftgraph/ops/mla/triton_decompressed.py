"""Triton kernel for MLA's decompressed form: causal multi-head attention over per-head keys and values
already rebuilt from the latents (forms.py builds them with one matmul per step).

Tiled like flash attention: one program per (block of BM query rows of one request, head). The rows'
keys lie in one contiguous range of the flat K/V (`token_key_start`); each key tile [BN] is read once
for BM rows, scored as q_nope . k_nope + q_pe . k_pe (the RoPE key is shared by all heads), and folded in
with an online softmax. `q_blocks` [NB, 2] (first row, end row) is the request-aligned tiling the host
planned, so this runs between graph pieces, never inside a capture. Same contract as
mla_decompressed_reference; runs under TRITON_INTERPRET=1 on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_dot_settings
from draftgraph.ops.launch import launch

BLOCK_M = 64  # query rows per program: the planner tiles each request's rows by this


@triton.jit
def _mla_decompressed_kernel(
    qn_ptr,
    qp_ptr,
    kn_ptr,
    kp_ptr,
    v_ptr,
    out_ptr,
    q_blocks_ptr,
    key_start_ptr,
    kv_len_ptr,
    stride_qnt,
    stride_qnh,
    stride_qpt,
    stride_qph,
    stride_knt,
    stride_knh,
    stride_kpt,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    scale,
    DN: tl.constexpr,
    DN_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(q_blocks_ptr + 2 * blk)
    end = tl.load(q_blocks_ptr + 2 * blk + 1)
    m = start + tl.arange(0, BM)
    m_mask = m < end
    kv_len = tl.load(kv_len_ptr + m, mask=m_mask, other=0)
    key0 = tl.load(key_start_ptr + start).to(tl.int64)
    hi = tl.max(kv_len, 0)  # causal: the block's last row sees the most keys
    dn = tl.arange(0, DN_PAD)
    dr = tl.arange(0, DR_PAD)
    dv = tl.arange(0, DV_PAD)
    qn = tl.load(
        qn_ptr + m[:, None].to(tl.int64) * stride_qnt + h * stride_qnh + dn[None, :],
        mask=m_mask[:, None] & (dn[None, :] < DN),
        other=0.0,
    )  # [BM, DN_PAD]
    qp = tl.load(
        qp_ptr + m[:, None].to(tl.int64) * stride_qpt + h * stride_qph + dr[None, :],
        mask=m_mask[:, None] & (dr[None, :] < DR),
        other=0.0,
    )  # [BM, DR_PAD]
    if DOT_F32:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV_PAD], tl.float32)
    for n0 in range(0, hi, BN):
        n = n0 + tl.arange(0, BN)
        rows = key0 + n
        n_mask = n < hi
        kn = tl.load(
            kn_ptr + rows[:, None] * stride_knt + h * stride_knh + dn[None, :],
            mask=n_mask[:, None] & (dn[None, :] < DN),
            other=0.0,
        )  # [BN, DN_PAD]
        kp = tl.load(
            kp_ptr + rows[:, None] * stride_kpt + dr[None, :], mask=n_mask[:, None] & (dr[None, :] < DR), other=0.0
        )  # [BN, DR_PAD]
        vv = tl.load(
            v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
            mask=n_mask[:, None] & (dv[None, :] < DV),
            other=0.0,
        )  # [BN, DV_PAD]
        if DOT_F32:
            kn = kn.to(tl.float32)
            kp = kp.to(tl.float32)
            vv = vv.to(tl.float32)
        s = tl.dot(qn, tl.trans(kn).to(qn.dtype), input_precision=PRECISION)
        s += tl.dot(qp, tl.trans(kp).to(qp.dtype), input_precision=PRECISION)
        s = tl.where(n[None, :] < kv_len[:, None], s * scale, float("-inf"))  # [BM, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past `end` see nothing
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + m[:, None].to(tl.int64) * stride_ot + h * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & (dv[None, :] < DV),
    )


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def mla_decompressed_triton(
    q_nope, q_pe, k_nope, k_pe, v, token_key_start, token_kv_len, scale, q_blocks
) -> torch.Tensor:
    """Same contract as mla_decompressed_reference; q_blocks [NB, 2] int64 tiles the rows by request, at
    most BLOCK_M rows each (forms.py's planner builds it)."""
    num_tokens, num_heads, head_nope = q_nope.shape
    head_v = v.shape[-1]
    out = torch.zeros(num_tokens, num_heads, head_v, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0 or q_blocks.shape[0] == 0:
        return out
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"MLA decompressed attention (triton) needs {name} with a unit last stride")
    dot_f32, precision = triton_dot_settings(q_nope.dtype)
    wide = max(_pad(head_nope), _pad(head_v)) >= 128
    launch(_mla_decompressed_kernel, (q_blocks.shape[0], num_heads))(
        q_nope,
        q_pe,
        k_nope,
        k_pe,
        v,
        out,
        q_blocks,
        token_key_start,
        token_kv_len,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_pe.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        DN=head_nope,
        DN_PAD=_pad(head_nope),
        DR=q_pe.shape[-1],
        DR_PAD=_pad(q_pe.shape[-1]),
        DV=head_v,
        DV_PAD=_pad(head_v),
        BM=BLOCK_M,
        BN=32 if wide and q_nope.dtype == torch.float32 else 64,
        PRECISION=precision,
        DOT_F32=dot_f32,
        num_warps=4,
    )
    return out
