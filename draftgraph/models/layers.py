"""Building blocks of a Llama-family decoder over the flat token layout ([T, ...] tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import draftgraph.ops.attention.op  # noqa: F401  (registers torch.ops.draftgraph.paged_attention)
import draftgraph.ops.collectives.fused  # noqa: F401  (registers linear_send, all_reduce_add_rms_norm_linear)
import draftgraph.ops.norm.op  # noqa: F401  (registers torch.ops.draftgraph.rms_norm and add_rms_norm)
import draftgraph.ops.rope.op as rope_op  # registers torch.ops.draftgraph.rope_qkv
from draftgraph.models.config import ModelConfig
from draftgraph.models.linear import Linear
from draftgraph.models.parallel.dense import RowParallelLinear, row_linear
from draftgraph.models.rope import apply_rope, cos_sin_table
from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


class RMSNorm(nn.Module):
    """x / rms(x) * w, the product in x's dtype (Llama; on CUDA `draftgraph::rms_norm`, one Triton kernel, unless
    `ops.norm_kernel` is off); `zero_centered`: x / rms(x) * (1 + w) in float32, then cast (Qwen3.5, whose w is
    stored around 0)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, *, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered and x.is_cuda and self.ops.norm_kernel:
            return torch.ops.draftgraph.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the norm of it); on CUDA the add and the norm are one op (`draftgraph::add_rms_norm`: one
        kernel) unless `ops.norm_kernel` is off."""
        if not self.zero_centered and x.is_cuda and self.ops.norm_kernel:
            return torch.ops.draftgraph.add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)


class Attention(nn.Module):
    """QKV projection (fused), optional q/k RMSNorm, RoPE, paged attention, output projection.

    Under tensor parallelism `cfg` is one rank's share (models/parallel/dense.py): the local heads, and `o` is
    row-parallel over `tp` (its sum over ranks inside)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        attn_impl: str,
        in_features: int | None = None,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = Linear(in_features or cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, ops=ops)
        self.o = row_linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp, ops)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops=ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops=ops) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window(layer)
        self.attn_impl = attn_impl
        self.ops = ops

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]):
        return self.attend(self.qkv(x), cos, sin, meta, kv)

    def attend(self, qkv, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor], send=False):
        """Everything after the QKV projection, from its output [T, q + 2 kv]. `send`: the row-parallel o_proj's
        partial, not summed (draftgraph::linear_send: the next all_reduce_add_rms_norm_linear sums it)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.uses_rope_write(qkv):
            # RoPE, and k and v written into the caches, in one kernel: the attention op gets no rows to write
            q = torch.ops.draftgraph.rope_qkv_write(q, k, v, cos, sin, kv[0], kv[1], meta.slot_mapping)
            k = v = q.new_empty((0, self.num_kv_heads, self.head_dim))
        elif self.uses_rope_kernel(qkv):
            q, k, v = torch.ops.draftgraph.rope_qkv(q, k, v, cos, sin)  # one kernel for q's and k's RoPE and v
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.attend_rotated(q, k, v, meta, kv, send)

    def uses_rope_kernel(self, x: torch.Tensor) -> bool:
        """Whether RoPE on q and k (and v's copy) is one kernel (draftgraph::rope_qkv): on CUDA with the RoPE kernel,
        no q/k norms, a head size the kernel takes."""
        return self.q_norm is None and x.is_cuda and self.ops.rope_kernel and rope_op.kernel_takes(self.head_dim)

    def uses_rope_write(self, x: torch.Tensor) -> bool:
        """Whether RoPE and the KV write are one kernel (draftgraph::rope_qkv_write): `uses_rope_kernel`, with its
        write and the Triton attention."""
        return self.uses_rope_kernel(x) and self.ops.rope_kv_write and self.attn_impl == "triton"

    def attend_rotated(self, q, k, v, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor], send=False):
        """The attention and the output projection from rotated queries [T, Hq, D] (k and v [T, Hkv, D]: the rows
        the attention op writes into the caches; none where the RoPE kernel wrote them)."""
        t = q.shape[0]
        out = torch.ops.draftgraph.paged_attention(
            q,
            k,
            v.contiguous(),
            kv[0],
            kv[1],
            meta.slot_mapping,
            meta.block_tables,
            meta.token_req,
            meta.token_kv_len,
            self.scale,
            self.window,
            self.attn_impl,
        )  # [T, Hq, D]
        if send:
            group = self.o.tp.group_name
            return torch.ops.draftgraph.linear_send(out.view(t, self.q_size), self.o.weight, group, False)
        return self.o(out.view(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul (under tensor parallelism: this rank's
    gate and up columns, `down` row-parallel over `tp`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        intermediate_size: int | None = None,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size  # DeepSeek's shared experts pass their own
        self.gate_up = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias, ops=ops)
        self.down = row_linear(self.inter, cfg.hidden_size, cfg.mlp_bias, tp, ops)
        self.ops = ops

    def forward(self, x):
        return self.finish(self.gate_up(x))

    def finish(self, gate_up):
        """The activation and the down projection, from the gate | up output."""
        if gate_up.is_cuda and self.ops.gemv and type(self.down) is Linear:  # one process: one op for both
            return torch.ops.draftgraph.silu_mul_linear(gate_up, self.down.weight, self.down.bias)
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    `input_norm=False` drops the first norm (EAGLE-1's layer 0 feeds fc's output straight in).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        attn_impl: str,
        input_norm: bool = True,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops) if input_norm else None
        self.attn = Attention(cfg, layer, attn_impl, tp=tp, ops=ops)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.mlp = MLP(cfg, tp=tp, ops=ops)
        self.ops = ops

    def forward(self, x, cos, sin, meta, kv):
        a = self.attn(self.input_norm(x) if self.input_norm is not None else x, cos, sin, meta, kv)
        h, n = self.post_norm.add_forward(x, a)  # h = x + a and post_norm(h) (one kernel with the norm ops)
        return h + self.mlp(n)

    def forward_unsummed(self, delta, residual, cos, sin, meta, kv, summed=True, last=False):
        """`forward` on the input residual + delta (delta None: residual itself), its output left as the pair
        (mlp out, h) whose sum `forward` returns: the sum is made by the next layer's input norm (add_forward,
        one kernel with the norm ops) instead of a kernel of its own. Needs the input norm. Equal values: the
        adds are the same float additions (x + y == y + x). With `sends_partials` the mlp out is this rank's
        partial (its all-reduce left to the next layer's input norm: ops/collectives/fused.py), and `summed`
        False says `delta` is the previous layer's. `last`: no layer follows (the model's final norm sums the down
        projection's partial with a plain all-reduce), so down does not send its partial into the fused rows: a
        send no reader consumes would leave data in a slot the next step's reader polls."""
        fused = self.norms_in_projections(residual)
        send = self.sends_partials(residual)
        if delta is not None and not summed and not send:  # a partial this layer cannot sum in its norm
            delta, summed = self.attn.o.tp.all_reduce(delta), True
        if delta is None:
            x, n = residual, self.input_norm(residual)
            qkv = self.attn.qkv(n)
        elif not summed:
            x, qkv = _sum_add_norm_project(delta, residual, self.input_norm, self.attn.qkv, self.attn.o.tp)
        elif fused and self.rope_in_projection(residual):  # the norm, QKV, RoPE and the KV write: one op
            norm, attn = self.input_norm, self.attn
            x, q = torch.ops.draftgraph.add_rms_norm_qkv_rope_write(
                delta, residual, norm.weight, norm.eps, attn.qkv.weight, attn.qkv.bias, cos, sin, kv[0], kv[1],
                meta.slot_mapping, attn.num_heads,
            )  # fmt: skip
            qkv = None
        elif fused:
            x, qkv = _add_norm_project(delta, residual, self.input_norm, self.attn.qkv)
        else:
            x, n = self.input_norm.add_forward(delta, residual)
            qkv = self.attn.qkv(n)
        if qkv is None:  # (rotated, the caches written)
            none = q.new_empty((0, self.attn.num_kv_heads, self.attn.head_dim))
            a = self.attn.attend_rotated(q, none, none, meta, kv, send)
        else:
            a = self.attn.attend(qkv, cos, sin, meta, kv, send)
        if send:  # o_proj's and down's partials summed inside the next norm + projection
            h, gate_up = _sum_add_norm_project(a, x, self.post_norm, self.mlp.gate_up, self.attn.o.tp)
            # the activation apart, as the row-parallel down runs it today: SiLU inside the down GEMV was measured a
            # net loss at TP 2 (docs/performance.md, "Tensor parallelism"); linear_send's silu_mul form is there
            gate, up = gate_up.split([self.mlp.inter, self.mlp.inter], dim=-1)
            down = self.mlp.down
            if last:  # (this rank's partial, unsent: RowParallelLinear's local product, summed by the caller)
                return torch.ops.draftgraph.linear(F.silu(gate) * up, down.weight, None), h
            return torch.ops.draftgraph.linear_send(F.silu(gate) * up, down.weight, down.tp.group_name, False), h
        if fused:
            h, gate_up = _add_norm_project(x, a, self.post_norm, self.mlp.gate_up)
            return self.mlp.finish(gate_up), h
        h, n = self.post_norm.add_forward(x, a)
        return self.mlp(n), h

    def norms_in_projections(self, residual: torch.Tensor) -> bool:
        """Whether `forward_unsummed` makes each add, norm and the projection after it one op
        (draftgraph::add_rms_norm_linear: the norm inside the one-row GEMV): on CUDA with the norm and GEMV ops,
        for unsharded projections; `ops.norm_in_projection` off turns it off."""
        return (
            residual.is_cuda
            and self.ops.norm_kernel
            and self.ops.gemv
            and self.ops.norm_in_projection
            and type(self.attn.qkv) is Linear
            and type(self.mlp.gate_up) is Linear
        )

    def rope_in_projection(self, residual: torch.Tensor) -> bool:
        """Whether `forward_unsummed` makes the input norm, the QKV projection, RoPE and the KV write one op
        (draftgraph::add_rms_norm_qkv_rope_write: one kernel at one row; ops.rope_in_projection): with
        `norms_in_projections` and the attention's RoPE write (`Attention.uses_rope_write`)."""
        ops = self.ops
        return ops.rope_in_projection and self.norms_in_projections(residual) and self.attn.uses_rope_write(residual)

    def sends_partials(self, residual: torch.Tensor) -> bool:
        """Whether `forward_unsummed` leaves o_proj's and down's all-reduces to the norms after them
        (ops.fuse_all_reduce: draftgraph::linear_send then all_reduce_add_rms_norm_linear, one launch
        fewer each at one row on a group with a peer all-reduce; the ops check the group when they run, so a
        graph traced anywhere is the same): with `norms_in_projections`, row-parallel o_proj and down, no biases."""
        return (
            self.ops.fuse_all_reduce
            and self.norms_in_projections(residual)
            and all(type(m) is RowParallelLinear and m.bias is None for m in (self.attn.o, self.mlp.down))
        )


def _sum_add_norm_project(partial, residual, norm: RMSNorm, proj: nn.Linear, tp: ParallelGroup):
    """(all_reduce(partial) + residual, proj(norm(...))) as draftgraph::all_reduce_add_rms_norm_linear."""
    return torch.ops.draftgraph.all_reduce_add_rms_norm_linear(
        partial, residual, norm.weight, norm.eps, proj.weight, proj.bias, tp.group_name
    )


def _add_norm_project(x, residual, norm: RMSNorm, proj: nn.Linear):
    """(x + residual, proj(norm(x + residual))) as draftgraph::add_rms_norm_linear."""
    return torch.ops.draftgraph.add_rms_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)


def rope_lookup(table: torch.Tensor, positions: torch.Tensor):
    """cos, sin [T, D/2] for `positions` from a [max_pos, D] cos|sin table."""
    cs = table[positions]  # [T, D]
    cos, sin = cs.chunk(2, dim=-1)
    return cos, sin


def materialize(module: nn.Module, cfg: ModelConfig, device) -> nn.Module:
    """Finish a module whose weights were assigned on the meta device: RoPE table, device, eval."""
    module.rope_table = cos_sin_table(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
    return module.to(device).eval().requires_grad_(False)
