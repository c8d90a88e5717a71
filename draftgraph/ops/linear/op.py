"""`torch.ops.draftgraph.linear(x, weight, bias)`: x @ weight.T + bias, as F.linear computes it.

On CUDA, for one row of x (a decode step at batch 1, a draft step's) the product is the Triton GEMV of
triton_gemv.py, which streams the weight closer to copy speed than cuBLAS's kernels do (an H100, 2026-11-26:
4.9 against 6.4 us for a 2048 x 2048 projection, 167 against 188 us for a 128k vocabulary's LM head;
docs/history/benchmarks-2026-11.md), and for 2-16 rows of an LM head (a verify at batch 1-3) its tensor-core kernel;
the rule is `GEMV_RULE`. Other products, and every other device, are F.linear. A
compiled piece calls it as one opaque node, as Inductor calls cuBLAS for a matmul anyway (no fusion is lost);
the row count may be symbolic: each captured size picks its path at capture.

Inside `compiling_ahead()` (compiler/pool/kernels_ahead.py) a call compiles every kernel variant the rule may launch,
since a trace leaves the row count symbolic and captured sizes may need different ones.
Registering the op is this module's one import-time action; Triton loads on the first CUDA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftgraph.ops.launch import ahead_now, pdl_level
from draftgraph.ops.registry import custom_op


@dataclass(frozen=True)
class GemvRule:
    """When the op runs the Triton kernels: one row always; 2 to `max_rows` rows when the weight has at least
    `multi_row_min_n` rows (an LM head: at 2-16 rows the tensor-core kernel beat cuBLAS only there, by 3-7 %;
    cuBLAS won for the 2k-16k-row projections; bench_gemv.py on an H100); weights in `dtypes`. One-row kernels
    launch with programmatic dependent launch at ops/launch.py's `PDL_RULE` level."""

    max_rows: int = 16
    multi_row_min_n: int = 32768
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

    def __post_init__(self):
        if not 0 <= self.max_rows <= 16:
            raise ValueError(f"GemvRule.max_rows={self.max_rows}: 0 (never) to 16 (the kernels' row tile)")

    def takes(self, rows: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if rows > 1 and weight.shape[0] < self.multi_row_min_n:
            return False
        return 0 < rows <= self.max_rows and x.dtype == weight.dtype and weight.dtype in self.dtypes


GEMV_RULE = GemvRule()


def check_linear(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> None:  # fmt: skip
    """Refuse shapes a linear op `name` cannot take, naming them: x [..., K] (silu_mul: gate | up, [..., 2K]),
    weight [N, K], bias [N]."""
    k = weight.shape[1] if weight.dim() == 2 else -1
    if x.dim() < 1 or k < 0 or x.shape[-1] != (2 if silu_mul else 1) * k:
        what = "gate_up [..., 2K] (gate | up)" if silu_mul else "x [..., K]"
        raise ValueError(f"{name} takes {what} and weight [N, K]; got {what.split()[0]} {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{name}'s bias must be [N] = [{weight.shape[0]}]; got {tuple(bias.shape)}")


@custom_op("draftgraph::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: the Triton GEMV for a few rows on CUDA (GEMV_RULE), F.linear otherwise."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not x.is_cuda:
        return F.linear(x, weight, bias)
    from draftgraph.ops.linear.triton_gemv import choose_config, gemv_triton

    pdl = pdl_level(x.device)  # (one row only: gemv_triton)
    if ahead_now():  # compile each kernel a captured size may launch: one row's, and 2-16 rows' (one variant)
        for stand_in in (1, 2):
            if GEMV_RULE.takes(stand_in, x, weight):
                gemv_triton(x.new_zeros((stand_in, k)), weight, bias, choose_config(stand_in, k), pdl)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    if not GEMV_RULE.takes(rows, x, weight):
        return F.linear(x, weight, bias)
    y = gemv_triton(x.reshape(rows, k), weight, bias, choose_config(rows, k), pdl)
    return y.view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _(x, weight, bias):
    check_linear("linear", x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op("draftgraph::silu_mul_linear", mutates_args=())
def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A SwiGLU's down projection: (silu(gate) * up) @ weight.T + bias, gate_up [..., 2I] = gate | up. On CUDA
    one row is one launch (the GEMV makes silu(gate) * up as it loads it: the elementwise kernel between the MLP's
    two products goes); more rows are the elementwise kernel then F.linear, as a compiled MLP ran them."""
    i = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1] if i else 0
    if not gate_up.is_cuda:
        gate, up = gate_up.split([i, i], dim=-1)
        return F.linear(F.silu(gate) * up, weight, bias)
    from draftgraph.ops.linear.triton_gemv import choose_config, silu_mul_gemv_triton, silu_mul_triton

    pdl = pdl_level(gate_up.device)

    n = weight.shape[0]
    if ahead_now():  # both paths' kernels: a trace leaves the row count symbolic
        one = gate_up.new_zeros((1, 2 * i))
        if GEMV_RULE.takes(1, gate_up, weight):
            silu_mul_gemv_triton(one, weight, bias, choose_config(1, i, silu_mul=True), pdl)
        silu_mul_triton(one)
        return gate_up.new_empty((*gate_up.shape[:-1], n))
    flat = gate_up.reshape(rows, 2 * i)
    if rows == 1 and GEMV_RULE.takes(1, gate_up, weight):
        y = silu_mul_gemv_triton(flat, weight, bias, choose_config(1, i, silu_mul=True), pdl)
    else:
        y = F.linear(silu_mul_triton(flat), weight, bias)
    return y.view(*gate_up.shape[:-1], n)


@silu_mul_linear.register_fake
def _(gate_up, weight, bias):
    check_linear("silu_mul_linear", gate_up, weight, bias, silu_mul=True)
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


@custom_op("draftgraph::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + residual (a residual stream) and y = rms_norm(s) @ weight.T + bias (the projection after a
    pre-norm), as ops/norm's add_rms_norm then F.linear compute them. On CUDA one row is one launch (the GEMV makes
    the norm as it loads the row: no normalised row in memory); more rows are add_rms_norm's kernel then F.linear.
    The Llama layers' default on CUDA (OpChoices.norm_in_projection off turns it off): 1.3 % off plain decode at batch 1
    on an H100, even at 8 and 32 (docs/history/benchmarks-2026-11.md)."""
    from draftgraph.ops.norm.op import rms_norm_reference

    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not x.is_cuda:
        s = (x + residual).contiguous()
        return s, F.linear(rms_norm_reference(s, norm_weight, eps), weight, bias)
    from draftgraph.ops.linear.triton_gemv import add_rms_norm_gemv_triton, choose_config
    from draftgraph.ops.norm.triton_rms_norm import rms_norm_triton

    n, pdl = weight.shape[0], pdl_level(x.device)
    if ahead_now():  # both paths' kernels: a trace leaves the row count symbolic
        one = x.new_zeros((1, k))
        if GEMV_RULE.takes(1, x, weight):
            add_rms_norm_gemv_triton(one, one, norm_weight, eps, weight, bias, choose_config(1, k, norm=True), pdl)
        rms_norm_triton(one, one, norm_weight, eps)
        return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], n))
    x2, r2 = x.reshape(rows, k), residual.reshape(rows, k)
    if rows == 1 and GEMV_RULE.takes(1, x, weight):
        s, y = add_rms_norm_gemv_triton(x2, r2, norm_weight, eps, weight, bias, choose_config(1, k, norm=True), pdl)
    else:
        s, normed = rms_norm_triton(x2, r2, norm_weight, eps)
        y = F.linear(normed, weight, bias)
    return s.view(x.shape), y.view(*x.shape[:-1], n)


@custom_op("draftgraph::add_rms_norm_qkv_rope_write", mutates_args=("k_cache", "v_cache"))
def add_rms_norm_qkv_rope_write(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, q): `add_rms_norm_linear` with the QKV weight [(Hq + 2 Hkv) D, K], then `draftgraph::rope_qkv_write` on its
    output: s = x + residual, q the rotated queries [T, Hq, D]; the rotated keys and the values go into the paged
    caches [blocks, block size, Hkv, D] at slot_mapping. One row on CUDA (the GEMV rule's dtypes, D / 2 a power of
    two) is one kernel (triton_qkv.py: RoPE and the KV write in the norm GEMV's epilogue, the same values);
    otherwise the two ops (OpChoices.rope_in_projection)."""
    from draftgraph.ops.rope.op import kernel_takes

    k, d = x.shape[-1], k_cache.shape[-1]
    rows, hkv, half = (x.numel() // k if k else 0), k_cache.shape[2], d // 2
    one_kernel = x.is_cuda and GEMV_RULE.takes(1, x, weight) and kernel_takes(d)
    pdl = pdl_level(x.device)
    if one_kernel and (rows == 1 or ahead_now()):
        from draftgraph.ops.linear.triton_gemv import choose_config
        from draftgraph.ops.linear.triton_qkv import norm_gemv_rope_write_triton

        args = (x.reshape(rows, k), residual.reshape(rows, k)) if rows == 1 else (x.new_zeros((1, k)),) * 2
        c, sn = (cos.reshape(1, half), sin.reshape(1, half)) if rows == 1 else (cos.new_zeros((1, half)),) * 2
        slots = slot_mapping.reshape(1) if rows == 1 else slot_mapping.new_zeros(1)
        s, q = norm_gemv_rope_write_triton(*args, norm_weight, eps, weight, bias, c, sn, k_cache, v_cache, slots,
                                           num_heads, choose_config(1, k, norm=True), pdl)  # fmt: skip
        if not ahead_now():  # (compiling ahead: both paths' kernels, the row count being symbolic in a trace)
            return s.view(x.shape), q.view(1, num_heads, d)
    s, qkv = torch.ops.draftgraph.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    q, kk, v = qkv.reshape(rows, (num_heads + 2 * hkv) * d).split([num_heads * d, hkv * d, hkv * d], dim=-1)
    shape = (rows, hkv, d)
    q = torch.ops.draftgraph.rope_qkv_write(
        q.view(rows, num_heads, d), kk.view(shape), v.view(shape), cos, sin, k_cache, v_cache, slot_mapping
    )
    return s, q


@add_rms_norm_qkv_rope_write.register_fake
def _(x, residual, norm_weight, eps, weight, bias, cos, sin, k_cache, v_cache, slot_mapping, num_heads):
    check_norm_linear("add_rms_norm_qkv_rope_write", x, residual, norm_weight, weight)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if weight.shape[0] != (num_heads + 2 * hkv) * d:
        raise ValueError(f"add_rms_norm_qkv_rope_write: weight {tuple(weight.shape)} is not the QKV projection of "
                         f"{num_heads} query heads and {hkv} KV heads of {d}")  # fmt: skip
    t = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((t, num_heads, d))


def check_norm_linear(name: str, x, residual, norm_weight, weight, rows: str = "...") -> None:
    """Refuse shapes add_rms_norm_linear (or its kernel: `rows` "1") cannot take, naming them."""
    k = x.shape[-1]
    ok = residual.shape == x.shape and norm_weight.shape == (k,) and weight.shape[1] == k
    if not ok or (rows == "1" and (x.dim() != 2 or x.shape[0] != 1)):
        raise ValueError(
            f"{name} takes x and residual [{rows}, K], norm weight [K], weight [N, K]; got x {tuple(x.shape)}, "
            f"residual {tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}, weight {tuple(weight.shape)}"
        )


@add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    check_norm_linear("add_rms_norm_linear", x, residual, norm_weight, weight)
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], weight.shape[0]))
