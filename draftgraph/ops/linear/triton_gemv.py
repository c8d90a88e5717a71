"""y = x @ w.T (+ b) for a few rows of x: a Triton kernel that streams the weight once at full bandwidth.

At batch 1 a decode step's projections are matrix-vector products: cuBLAS runs the 1B-shaped model's q/k/v and
output projections (8-13 MB of weight each) at 1.3-1.95 TB/s on an H100 where a copy moves 3 TB/s
(docs/history/benchmarks-2026-11.md, 2026-11-26). Two kernels, each program owning BLOCK_N output columns (weight rows)
and reading each of their bytes once:
- one row (`_gemv_kernel`): [BLOCK_N, BLOCK_K] weight tiles times the row, summed elementwise in float32 and
  reduced once; small tiles, many programs, the loads of a tile all in flight at once;
- 2-16 rows (`_dot_kernel`): the rows padded to 16, tensor-core products of [16, BLOCK_K] x [BLOCK_K, BLOCK_N]
  accumulated in float32, the weight streamed through Triton's software pipeline.
Both round the float32 sum (plus bias) once to x's dtype, as cuBLAS does. `GemvConfig` is the tiling and
`choose_config` picks it per shape (measured: scripts/bench_gemv.py). The one-row bodies are jit helpers
(`row_gemv`, `norm_rstd`, `normed_dot`, `store_columns`) that ops/collectives/fused.py's kernels share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from draftgraph.ops import triton_math
from draftgraph.ops.backends import triton_dot_settings, triton_interpreting
from draftgraph.ops.launch import launch
from draftgraph.ops.linear.op import check_norm_linear
from draftgraph.ops.triton_pdl import pdl_args, pdl_prologue, pdl_release, pdl_wait


@dataclass(frozen=True)
class GemvConfig:
    """The kernel's tiling: output columns per program, the K chunk loaded at once, warps per program."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 3  # the tensor-core kernel's software pipeline (rows > 1)

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name}={v}: a power of two, e.g. 16")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages={self.num_stages}: 1 or more")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps={self.num_warps}: one of 1, 2, 4, 8, 16")


@triton.jit(do_not_specialize=["M"])  # one variant for every row count the tile covers
def _dot_kernel(x, w, b, y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
    """2-16 rows: [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tensor-core products (rows padded to 16), the weight's
    tiles streamed through the software pipeline."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    xp = x + tl.minimum(rm, M - 1)[:, None] * sxm + ks[None, :]  # padding rows reread the last row
    wp = w + cols.to(tl.int64)[None, :] * swn + ks[:, None]  # the weight tile transposed: [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        xt = tl.load(xp, mask=k_ok[None, :], other=0.0)
        wt = tl.load(wp, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter's half-precision dots are wrong (ops/backends.py)
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)  # float32: IEEE, not TF32
        xp += BLOCK_K
        wp += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y + rm[:, None] * sym + cols[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & col_ok[None, :])


@triton.jit
def _silu_mul(g, u, ACCURATE: tl.constexpr):
    """silu(g) * u as eager torch rounds it: silu in float32 rounded to g's dtype, the product rounded again."""
    gf = g.to(tl.float32)
    sg = (gf / (1.0 + triton_math.exp(-gf, ACCURATE))).to(g.dtype)
    return (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_kernel(x, y, M, INTER, sxm, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    """y [M, INTER] = silu(x[:, :INTER]) * x[:, INTER:] (the rows a product with more rows takes; one launch)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    g = tl.load(x + row * sxm + cols, mask=ok, other=0.0)
    u = tl.load(x + row * sxm + INTER + cols, mask=ok, other=0.0)
    tl.store(y + row * INTER + cols, _silu_mul(g, u, ACCURATE), mask=ok)


@triton.jit
def row_gemv(x, w, N, K, swn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
             ACCURATE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """This program's BLOCK_N columns of one row's product: (cols, col_ok, their float32 sums), the products summed
    elementwise in float32 over K's chunks and reduced once. SILU_MUL: the row is silu(x[:K]) * x[K:2K] (a
    SwiGLU's gate and up halves), made as it is loaded. PDL: programmatic dependent launch's level
    (ops/triton_pdl.py). Also `_gemv_kernel`'s body, and fused.py's writer's."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = weight rows
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w + cols.to(tl.int64)[:, None] * swn
    pdl_prologue(PDL)
    start = 0
    if PDL >= 2:  # the first chunk of weight loaded before the wait, its product after
        wt = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        pdl_wait(PDL)
        acc = _row_chunk(acc, wt, x, K, ks, ks < K, SILU_MUL, ACCURATE)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        wt = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _row_chunk(acc, wt, x, K, kk, k_ok, SILU_MUL, ACCURATE)
    return cols, col_ok, tl.sum(acc, axis=1)


@triton.jit
def _row_chunk(acc, wt, x, K, kk, k_ok, SILU_MUL: tl.constexpr, ACCURATE: tl.constexpr):
    xv = tl.load(x + kk, mask=k_ok, other=0.0)
    if SILU_MUL:
        xv = _silu_mul(xv, tl.load(x + K + kk, mask=k_ok, other=0.0), ACCURATE)
    return acc + wt.to(tl.float32) * xv.to(tl.float32)[None, :]


@triton.jit
def store_columns(out, b, y, cols, col_ok, HAS_BIAS: tl.constexpr):
    """The float32 sums `out` (+ the bias's columns) rounded once to y's dtype, stored at y's columns."""
    if HAS_BIAS:
        out += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y + cols, out.to(y.dtype.element_ty), mask=col_ok)


@triton.jit
def norm_rstd(sv, s_out, whole, in_row, K, eps, ACCURATE: tl.constexpr):
    """The RMS norm's 1 / rms of the summed row sv (x's dtype, the whole row in every program: small, in L2);
    program 0 stores sv, the new residual."""
    sf = sv.to(tl.float32)
    rstd = triton_math.rsqrt(tl.sum(sf * sf, axis=0) / K + eps, ACCURATE)
    if tl.program_id(0) == 0:
        tl.store(s_out + whole, sv, mask=in_row)
    return rstd


@triton.jit
def normed_dot(acc, sk, rstd, nw, w_rows, kk, k_ok, col_ok):
    """acc plus one K chunk of the normalised row against this program's weight rows: sk, the summed row's chunk
    (x's dtype), normalised with ops/norm's roundings (the normalised chunk and its product with the norm weight
    each rounded to that dtype)."""
    wt = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    return normed_dot_w(acc, sk, rstd, nw, wt, kk, k_ok)


@triton.jit
def normed_dot_w(acc, sk, rstd, nw, wt, kk, k_ok):
    """`normed_dot` on a chunk of weight already loaded (`wt`, [BLOCK_N, BLOCK_K])."""
    dt = sk.dtype
    nk = (sk.to(tl.float32) * rstd).to(dt)
    nk = (tl.load(nw + kk, mask=k_ok, other=0.0).to(tl.float32) * nk.to(tl.float32)).to(dt)
    return acc + wt.to(tl.float32) * nk.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(x, w, b, y, N, K, swn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SILU_MUL: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One row (`row_gemv`), + bias, rounded once. PDL: programmatic dependent launch's level (ops/triton_pdl.py)."""
    cols, col_ok, out = row_gemv(x, w, N, K, swn, BLOCK_N, BLOCK_K, SILU_MUL, ACCURATE, PDL)
    pdl_release(PDL)
    store_columns(out, b, y, cols, col_ok, HAS_BIAS)


@triton.jit
def _norm_gemv_kernel(x, r, nw, w, b, s_out, y, N, K, swn, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ROW: tl.constexpr, ACCURATE: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    """One row of rms_norm(x + r) @ w.T (+ b), and s = x + r (written by program 0): every program sums the
    row's squares itself (the row is small and in L2), then streams its weight rows against the normalised row
    made chunk by chunk, with ops/norm's roundings (s, the normalised row and its product with the norm weight
    each rounded to x's dtype). PDL: as `_gemv_kernel`'s (ops/triton_pdl.py)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out = norm_row_gemv(x, r, nw, w, s_out, cols, col_ok, K, swn, eps, BLOCK_N, BLOCK_K, ROW, ACCURATE, PDL)
    store_columns(out, b, y, cols, col_ok, HAS_BIAS)


@triton.jit
def norm_row_gemv(x, r, nw, w, s_out, cols, col_ok, K, swn, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ROW: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """`_norm_gemv_kernel`'s body for the weight rows `cols` (BLOCK_N of them, any order): their float32 sums
    (s = x + r stored by program 0); also triton_qkv.py's, whose columns pair each head's halves. The PDL release
    is made here, after the last load."""
    dt = x.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    w_rows = w + cols.to(tl.int64)[:, None] * swn
    pdl_prologue(PDL)
    if PDL >= 2:  # the first chunk of weight before the wait
        w0 = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        pdl_wait(PDL)
    whole = tl.arange(0, ROW)
    in_row = whole < K
    sv = (tl.load(x + whole, mask=in_row, other=0.0).to(tl.float32)
          + tl.load(r + whole, mask=in_row, other=0.0).to(tl.float32)).to(dt)  # fmt: skip
    rstd = norm_rstd(sv, s_out, whole, in_row, K, eps, ACCURATE)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    start = 0
    if PDL >= 2:
        k_ok = ks < K
        sk = (tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
              + tl.load(r + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dt)  # fmt: skip
        acc = normed_dot_w(acc, sk, rstd, nw, w0, ks, k_ok)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        sk = (tl.load(x + kk, mask=k_ok, other=0.0).to(tl.float32)
              + tl.load(r + kk, mask=k_ok, other=0.0).to(tl.float32)).to(dt)  # fmt: skip
        acc = normed_dot(acc, sk, rstd, nw, w_rows, kk, k_ok, col_ok)
    pdl_release(PDL)
    return tl.sum(acc, axis=1)


def add_rms_norm_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    pdl: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (s, y) with s = x + residual [1, K] and y = rms_norm(s) @ weight.T (+ bias) [1, N], one launch
    (`pdl`: the programmatic-dependent-launch level, ops/triton_pdl.py; 0 off)."""
    check_norm_linear("add_rms_norm_gemv_triton", x, residual, norm_weight, weight, rows="1")
    k, n = x.shape[-1], weight.shape[0]
    x, residual, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual, weight))
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n and k:
        launch(_norm_gemv_kernel, (triton.cdiv(n, config.block_n),))(
            x, residual, norm_weight, weight, bias if bias is not None else weight, s, y, n, k, weight.stride(0), eps,
            HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            ROW=triton.next_power_of_2(k), ACCURATE=not triton_interpreting(), num_warps=config.num_warps,
            **pdl_args(pdl),
        )  # fmt: skip
    return s, y


def m_block(rows: int) -> int:
    """The kernel's row tile: the row count rounded up to a power of two (one variant per tile, not per count)."""
    return triton.next_power_of_2(max(rows, 1))


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig, pdl: int = 0
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype (one row: any float dtype; 2-16 rows:
    bfloat16 or float16). `pdl` (one row): the programmatic-dependent-launch level (ops/triton_pdl.py; 0 off)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m > 1 and x.dtype not in (torch.bfloat16, torch.float16):
        # float32 operands on an H100 differed from F.linear by TF32-sized errors; their products
        # stay on cuBLAS (the op's rule never sends them here)
        raise ValueError(f"gemv_triton: {m} rows of {x.dtype}: the tensor-core kernel takes bfloat16 or float16")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 1 and n:
        dot_f32, precision = triton_dot_settings(x.dtype)
        launch(_dot_kernel, (triton.cdiv(n, config.block_n),))(
            x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=max(16, m_block(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            DOT_F32=dot_f32, PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    elif m and n:
        launch(_gemv_kernel, (triton.cdiv(n, config.block_n),))(
            x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), HAS_BIAS=bias is not None,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, SILU_MUL=False, ACCURATE=not triton_interpreting(),
            num_warps=config.num_warps, **pdl_args(pdl),
        )  # fmt: skip
    return y


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] -> [M, I] in one launch (eager torch's rounding)."""
    m, i2 = gate_up.shape
    i = i2 // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    y = torch.empty((m, i), dtype=gate_up.dtype, device=gate_up.device)
    if m and i:
        block = min(1024, triton.next_power_of_2(i))
        launch(_silu_mul_kernel, (m, triton.cdiv(i, block)))(
            gate_up, y, m, i, gate_up.stride(0), BLOCK=block, ACCURATE=not triton_interpreting(), num_warps=4
        )
    return y


def silu_mul_gemv_triton(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig, pdl: int = 0
) -> torch.Tensor:
    """One row: (silu(gate) * up) @ weight.T (+ bias) with gate_up [1, 2I] and weight [N, I], in one launch
    (`pdl`: as gemv_triton's)."""
    m, i2 = gate_up.shape
    n, k = weight.shape
    if m != 1 or i2 != 2 * k:
        raise ValueError(f"silu_mul_gemv_triton takes gate_up [1, 2K] and weight [N, K]; got {(m, i2)}, {(n, k)}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    y = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        launch(_gemv_kernel, (triton.cdiv(n, config.block_n),))(
            gate_up, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SILU_MUL=True,
            ACCURATE=not triton_interpreting(), num_warps=config.num_warps, **pdl_args(pdl),
        )  # fmt: skip
    return y


def choose_config(rows: int, k: int, silu_mul: bool = False, norm: bool = False) -> GemvConfig:
    """The tiling for a product of `rows` rows of `k` inputs, from scripts/bench_gemv.py's sweep on an H100 (2026-11-26,
    the 1B-shaped model's projections): one row, 2 columns x 1024 of K per program on 4 warps, within 2 % of the
    best tiling at every shape; 2-16 rows, 64 columns x 256 of K, 4 warps, 4 stages (the LM head's best). K
    below the block: the whole row in one load. `silu_mul`: every program makes the activation of the whole row,
    so 8 columns per program (a quarter of the programs, the sweep's down projection within 4 % of its best; at 2
    columns the fused kernel was 7 us a step slower than the two it replaced)."""
    block_k = min(1024, max(16, triton.next_power_of_2(k)))
    if rows <= 1 and (silu_mul or norm):  # norm: the same reasoning (bench_gemv --fused: 8 columns best)
        return GemvConfig(block_n=8, block_k=block_k, num_warps=8)
    if rows <= 1:
        return GemvConfig(block_n=2, block_k=block_k, num_warps=4)
    return GemvConfig(block_n=64, block_k=min(block_k, 256), num_warps=4, num_stages=4)
