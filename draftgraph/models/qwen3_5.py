"""Qwen3.5 decoder layers (qwen3_5_text, qwen3_5_moe_text): Gated DeltaNet linear attention or gated full
attention, then a dense SwiGLU MLP or a Qwen MoE. `CausalLM` (llama.py) builds these when its config has a
HybridConfig; every norm but the DeltaNet's gated one is zero-centred (x * (1 + w)).

Gated DeltaNet per token: in_proj -> [q|k|v] (conv_dim), z (HV*Dv), b, a (HV each); the custom op
`draftgraph::gated_delta_net` (ops/linear_attention) runs the short causal conv and the gated delta rule
with g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), reading and writing the request's state
rings; then RMSNorm per v head gated by silu(z), and out_proj. Its cache entry is (conv_states, ssm_states,
block_rows): block_rows maps a request's first KV block to its state row (runtime/state_cache.py).

Gated attention: q_proj yields [q | gate] per head; q/k RMSNorm per head, RoPE on the first rotary_dim dims
(partial RoPE; Qwen3.5's mrope has equal sections for text, i.e. plain RoPE), paged attention, then
out * sigmoid(gate) and o_proj.

Tensor parallelism (`tp`; models/parallel/hybrid.py): `cfg` is one rank's share (its k / v heads, attention
heads, expert slices); out_proj / o_proj / down row-parallel, the MoE's output all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import draftgraph.ops.linear_attention.op  # noqa: F401  (registers torch.ops.draftgraph.gated_delta_net)
import draftgraph.ops.moe.op  # noqa: F401  (registers torch.ops.draftgraph.moe_experts)
from draftgraph.models.config import ModelConfig
from draftgraph.models.layers import MLP, RMSNorm
from draftgraph.models.parallel.dense import row_linear
from draftgraph.models.rope import apply_rope
from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.backends import linear_attention_impl
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (weight around 1, product in the input dtype), times silu(gate) in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        la = cfg.hybrid.linear
        self.la = la
        self.in_proj = nn.Linear(cfg.hidden_size, la.conv_dim + la.value_dim + 2 * la.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(la.conv_dim, la.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads))
        self.norm = GatedRMSNorm(la.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = row_linear(la.value_dim, cfg.hidden_size, False, tp, ops)
        self.attn_impl = attn_impl  # the attention setting (build/engine.py set_kernel_impl may change it)

    @property
    def impl(self) -> str:
        """The op's implementation, following the attention setting."""
        return linear_attention_impl(self.attn_impl)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: tuple[torch.Tensor, ...]):
        la, t = self.la, x.shape[0]
        conv_states, ssm_states, block_rows = cache
        mixed, z, b, a = self.in_proj(x).split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads], dim=-1)
        beta = b.sigmoid().float()  # [T, HV] (the sigmoid in the model dtype, as transformers)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, HV] log decay
        rows = block_rows[meta.block_tables[:, 0].long()]  # [B] each request's state row
        out = torch.ops.draftgraph.gated_delta_net(
            mixed.contiguous(),
            g,
            beta,
            self.conv_weight,
            conv_states,
            ssm_states,
            rows,
            meta.query_start_loc,
            meta.token_req,
            meta.token_kv_len,
            self.impl,
        )  # [T, HV, Dv]
        out = self.norm(out, z.reshape(t, la.num_v_heads, la.head_v_dim))
        return self.out_proj(out.reshape(t, la.value_dim))


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size, self.rotary_dim = cfg.q_size, cfg.kv_size, cfg.rotary_dim
        self.gated = cfg.hybrid.attn_output_gate
        q_out = cfg.q_size * (2 if self.gated else 1)
        self.qkv = nn.Linear(cfg.hidden_size, q_out + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = row_linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp, ops)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, zero_centered=True, ops=ops)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, zero_centered=True, ops=ops)
        self.scale = cfg.head_dim**-0.5
        self.attn_impl = attn_impl

    def _rope(self, x, cos, sin):
        rd = self.rotary_dim
        if rd == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, ...]):
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv(x).split([self.q_size * (2 if self.gated else 1), self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(t, h, 2 * d).chunk(2, dim=-1)  # per head [q | gate]
            gate = gate.reshape(t, self.q_size)
        q = self.q_norm(q.reshape(t, h, d))  # [T, Hq, D]
        k = self.k_norm(k.view(t, self.num_kv_heads, d))  # [T, Hkv, D]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        out = torch.ops.draftgraph.paged_attention(
            q.contiguous(), k.contiguous(), v.view(t, self.num_kv_heads, d).contiguous(), kv[0], kv[1],
            meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len, self.scale, 0, self.attn_impl,
        ).view(t, self.q_size)  # fmt: skip
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out)


def qwen_route(x, gate, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, k] of tokens x [T, H] by Qwen's router: softmax over logits in the model dtype
    (as transformers), top-k, renormalised."""
    weights, ids = torch.softmax(F.linear(x, gate).float(), dim=-1).topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float(), ids


class QwenMoE(nn.Module):
    """Softmax router, top-k renormalised, routed experts (the moe_experts op) + sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        assert tp.is_single or not cfg.mlp_bias, "a split MoE sums partial outputs: no biases to add twice"
        m = cfg.hybrid.moe
        self.top_k = m.top_k
        self.gate = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.gate_up = nn.Parameter(torch.empty(m.num_experts, 2 * m.moe_intermediate_size, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, m.moe_intermediate_size))
        self.shared = MLP(cfg, m.shared_expert_intermediate_size, ops=ops)  # this rank's slice under tensor parallelism
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.attn_impl = attn_impl
        self.tp = tp

    def forward(self, x):
        weights, ids = qwen_route(x, self.gate, self.top_k)
        out = torch.ops.draftgraph.moe_experts(x, self.gate_up, self.down, ids, weights, self.attn_impl)
        out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return self.tp.all_reduce(out)  # partial sums over the intermediate slices (x itself for one process)


class Qwen3_5Layer(nn.Module):
    """Pre-norm block: h = x + mixer(norm(x)); out = h + ffn(norm(h)); the mixer (`attn`) a Gated DeltaNet or
    gated attention by the layer's type, the ffn a dense MLP or a Qwen MoE."""

    def __init__(
        self, cfg: ModelConfig, layer: int, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS
    ):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, ops=ops)
        self.linear = cfg.hybrid.is_linear(layer)
        mixer = GatedDeltaNet if self.linear else GatedAttention
        self.attn = mixer(cfg, attn_impl, tp, ops)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, ops=ops)
        self.mlp = QwenMoE(cfg, attn_impl, tp, ops) if cfg.hybrid.moe is not None else MLP(cfg, tp=tp, ops=ops)

    def forward(self, x, cos, sin, meta, kv):
        h = x + self.attn(self.input_norm(x), cos, sin, meta, kv)
        return h + self.mlp(self.post_norm(h))
