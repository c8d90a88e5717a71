"""DeepSeek-V3 decoder layer: multi-head latent attention (MLA) and a mixture of experts (or a dense MLP
in the first `first_k_dense_replace` layers). `CausalLM` (llama.py) builds these when its config has MLA.

MLA per token: the query q = q_b(norm(q_a(x))) (or q_proj(x)) split per head into q_nope [dn] and q_pe
[dr]; the cache entry c = norm(kv_a(x)[:r]) and k_pe = kv_a(x)[r:] (shared by all heads); RoPE on q_pe and
k_pe. The op writes the cache and attends, absorbing kv_b into the queries (decode, verify) or rebuilding
per-head K/V from the latents (long prefills), as ops/mla/forms.py decides; then o_proj.

Tensor parallelism (models/parallel/mla.py): `tp` on the constructors; `cfg` is then one rank's share (its
heads, its slice of every expert), o_proj row-parallel, the MoE's output all-reduced; the latent is whole.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import draftgraph.ops.mla.op  # noqa: F401  (registers torch.ops.draftgraph.mla_attention)
from draftgraph.models.config import ModelConfig
from draftgraph.models.layers import MLP, RMSNorm
from draftgraph.models.moe import MoE
from draftgraph.models.parallel.dense import row_linear
from draftgraph.models.rope import apply_rope, apply_rope_interleaved
from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup
from draftgraph.ops.mla.forms import check_form


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        a = cfg.mla
        self.a, self.num_heads = a, cfg.num_heads
        bias = cfg.qkv_bias
        if a.q_lora_rank:
            self.q_a = nn.Linear(cfg.hidden_size, a.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(a.q_lora_rank, 1e-6, ops=ops)
            self.q_b = nn.Linear(a.q_lora_rank, cfg.num_heads * a.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * a.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(cfg.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=bias)
        self.kv_a_norm = RMSNorm(a.kv_lora_rank, 1e-6, ops=ops)
        self.kv_b = nn.Linear(a.kv_lora_rank, cfg.num_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o = row_linear(cfg.num_heads * a.v_head_dim, cfg.hidden_size, bias, tp, ops)  # local heads' values
        self.rope = apply_rope_interleaved if a.rope_interleave else apply_rope
        self.attn_impl = attn_impl
        self.form = "auto"  # which MLA form runs for which rows (ops/mla/forms.py); set_mla_form

    def project(self, x, cos, sin):
        """q_nope [T, H, dn], q_pe [T, H, dr] (RoPE'd), the latent c [T, r], k_pe [T, dr] (RoPE'd), and the
        normed query latent [T, q_lora_rank] (None without q LoRA; V3.2's indexer reads it)."""
        a, t, h = self.a, x.shape[0], self.num_heads
        q_resid = self.q_a_norm(self.q_a(x)) if a.q_lora_rank else None
        q = self.q_b(q_resid) if a.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(t, h, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        c = self.kv_a_norm(c)
        q_pe = self.rope(q_pe, cos, sin)
        k_pe = self.rope(k_pe.view(t, 1, a.qk_rope_head_dim), cos, sin).view(t, a.qk_rope_head_dim)
        return q_nope, q_pe, c, k_pe, q_resid

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, ...]):
        a, t, h = self.a, x.shape[0], self.num_heads
        q_nope, q_pe, c, k_pe, _ = self.project(x, cos, sin)
        out = torch.ops.draftgraph.mla_attention(
            q_nope,
            q_pe.contiguous(),
            c.contiguous(),
            k_pe.contiguous(),
            kv[0],
            kv[1],
            self.kv_b.weight,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_req,
            meta.token_kv_len,
            a.softmax_scale,
            self.form,
            self.attn_impl,
        )  # [T, H, dv]
        return self.o(out.reshape(t, h * a.v_head_dim))


def set_mla_form(model: nn.Module, form: str) -> int:
    """Set the MLA form ("auto", "absorbed", "decompressed": ops/mla/forms.py) of every MLA layer in
    `model`; returns how many. Set it before compiling: traced graphs keep the form they saw."""
    check_form(form)
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    for m in layers:
        m.form = form
    return len(layers)


class DeepseekLayer(nn.Module):
    """Pre-norm block: h = x + mla(norm(x)); out = h + ffn(norm(h)), ffn a MoE or a dense MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        attn_impl: str,
        attention: type[nn.Module] = MLAttention,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.attn = attention(cfg, attn_impl, tp, ops)  # MLAttention, or V3.2's sparse MLA (deepseek_v32.py)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.mlp = MoE(cfg, attn_impl, tp, ops) if cfg.is_moe_layer(layer) else MLP(cfg, tp=tp, ops=ops)

    def forward(self, x, cos, sin, meta, kv):
        h = x + self.attn(self.input_norm(x), cos, sin, meta, kv)
        return h + self.mlp(self.post_norm(h))


_RULES = {
    "attn.q_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_a.bias": "self_attn.q_a_proj.bias",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b.weight": "self_attn.q_b_proj.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "attn.o.bias": "self_attn.o_proj.bias",
    "mlp.gate": "mlp.gate.weight",
    "mlp.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.gate_up": "mlp.experts.gate_up_proj",
    "mlp.down": "mlp.experts.down_proj",
    "input_norm.weight": "input_layernorm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
}


def convert_deepseek_layer(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One transformers DeepSeek-V3 layer at prefix `src` -> ours at `dst` (pops from state). Experts come
    fused ([E, 2I, H] / [E, H, I], transformers 5 in memory) or one module per expert (the hub's layout and
    what save_pretrained writes); both become the fused tensors."""
    out = {}
    pat = re.compile(re.escape(src) + r"mlp\.experts\.(\d+)\.")
    per_expert = sorted({int(m.group(1)) for k in state if (m := pat.match(k))})
    if per_expert:
        gate_up, down = [], []
        for e in per_expert:
            p = f"{src}mlp.experts.{e}."
            gate_up.append(torch.cat([state.pop(p + "gate_proj.weight"), state.pop(p + "up_proj.weight")], dim=0))
            down.append(state.pop(p + "down_proj.weight"))
        out[dst + "mlp.gate_up"] = torch.stack(gate_up)
        out[dst + "mlp.down"] = torch.stack(down)
    for ours, theirs in _RULES.items():
        if src + theirs in state:
            out[dst + ours] = state.pop(src + theirs)
    for part in ("mlp", "mlp.shared_experts"):  # the dense MLP of the first layers, the shared experts
        keys = [f"{src}{part}.{n}_proj.weight" for n in ("gate", "up", "down")]
        if all(k in state for k in keys):
            name = "mlp" if part == "mlp" else "mlp.shared"
            out[f"{dst}{name}.gate_up.weight"] = torch.cat([state.pop(keys[0]), state.pop(keys[1])], dim=0)
            out[f"{dst}{name}.down.weight"] = state.pop(keys[2])
    return out
