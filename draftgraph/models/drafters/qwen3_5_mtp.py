"""Qwen3.5's multi-token-prediction (MTP) head as a drafter, from its checkpoint layout (`mtp.*`, which
transformers skips on load), reused for every draft step.

x = fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden))); h = norm(layer(x));
logits = head(h). The layer is a Qwen3.5 full-attention decoder layer (gated attention, dense MLP or the
MoE), so the drafter keeps paged KV and no linear-attention state. The embedding and head are the
target's. `hidden` is the target's final-normed hidden state at the first step and the head's own normed
output after (as vLLM and SGLang feed it). Every norm is zero-centred.

Keys: mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
mtp.norm.weight, mtp.layers.0.* (the target's layer names: self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.*,
input_layernorm, post_attention_layernorm).

Over a tensor-parallel target (drafters/parallel_heads.py): split like it (the layer's heads and MLP / expert
slices, the target's vocab-parallel embedding and head) or replicated (the whole layer; the target's
embedding and head gathered once into its own `embed_tokens` / `lm_head`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.base import Drafter, mismatch
from draftgraph.models.drafters.parallel_heads import head_share
from draftgraph.models.layers import RMSNorm, materialize, rope_lookup
from draftgraph.models.parallel.dense import full_config
from draftgraph.models.qwen3_5 import Qwen3_5Layer
from draftgraph.models.qwen3_5_weights import convert_qwen3_5_layer
from draftgraph.models.weights import assign_weights
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The head's decoder shape: one full-attention layer of the target's."""
    hybrid = dataclasses.replace(target.hybrid, layer_types=("full_attention",))
    return target.replace(num_layers=1, sliding_windows=(), hybrid=hybrid)


class Qwen3_5MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        attn_impl: str,
        tp: ParallelGroup = SINGLE,
        replicated: bool = False,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered=True, ops=ops)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered=True, ops=ops)
        self.block = Qwen3_5Layer(cfg, 0, attn_impl, tp, ops)
        self.norm = RMSNorm(h, eps, zero_centered=True, ops=ops)
        self._target = [target]  # not a submodule: its weights stay the target's
        # `replicated`: whole on every rank over a split target, with the target's gathered embedding and head
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if replicated else None
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if replicated else None
        assert replicated or target.tp == tp, "a borrowed embedding and head must be split like the head"
        self.register_buffer("rope_table", torch.empty(cfg.max_position_embeddings, cfg.rotary_dim), persistent=False)

    @property
    def num_kv_layers(self) -> int:
        return 1

    def forward(self, input_ids, positions, hidden, meta, kv_caches):
        cos, sin = rope_lookup(self.rope_table, positions)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed_tokens
        emb = embed(input_ids)  # [T, H]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        out = self.norm(self.block(x, cos, sin, meta, kv_caches[0]))
        return out, out

    def compute_logits(self, hidden, indices=None):
        if self.lm_head is None:
            return self._target[0].compute_logits(hidden, indices)
        return self.lm_head(hidden if indices is None else hidden[indices])

    @classmethod
    def from_state_dict(
        cls,
        state: dict,
        target: CausalLM,
        device,
        attn_impl,
        dtype=None,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ) -> Qwen3_5MTPDrafter:
        """`state`: a whole Qwen3.5 checkpoint (its `mtp.*` keys are read) or the head's keys alone; `tp`: the
        target's group (split alike) or one process (replicated)."""
        if "mtp.fc.weight" not in state:
            raise ValueError("no Qwen3.5 MTP head found: expected mtp.fc.weight (and mtp.layers.0.*) in the checkpoint")
        full = full_config(target.cfg)
        cfg = mtp_config(full if dtype is None else full.replace(dtype=dtype))
        mine = {k[len("mtp.") :]: v for k, v in state.items() if k.startswith("mtp.")}
        if tuple(mine["fc.weight"].shape) != (cfg.hidden_size, 2 * cfg.hidden_size):
            raise mismatch("mtp.fc.weight shape", list(mine["fc.weight"].shape), [cfg.hidden_size, 2 * cfg.hidden_size],
                           "the MTP head must come from this target's checkpoint")  # fmt: skip
        extra = sorted({k.split(".")[1] for k in mine if k.startswith("layers.")} - {"0"})
        if extra:
            raise ValueError(f"the MTP head has layers {['0', *extra]}; draftgraph reuses one layer (mtp.layers.0)")
        cfg, mine = head_share("mtp", cfg, mine, target, tp, ("embed_tokens.weight", "lm_head.weight"))
        ours = convert_qwen3_5_layer(mine, "layers.0.", "block.")
        ours.update(mine)
        with torch.device("meta"):
            model = cls(cfg, target, attn_impl, tp, replicated="lm_head.weight" in ours, ops=ops)
        assign_weights(model, ours, "Qwen3.5 MTP drafter", cfg.dtype)
        return materialize(model, cfg, device)


def random_mtp_weights(cfg: ModelConfig, gen: torch.Generator, std: float = 0.05) -> dict[str, torch.Tensor]:
    """A random head in the checkpoint layout (for tests and the built-in pairs: no real acceptance)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    p = "mtp.layers.0."

    def r(*shape):
        return torch.randn(*shape, generator=gen) * std

    w = {
        "mtp.fc.weight": r(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": r(h),
        "mtp.pre_fc_norm_hidden.weight": r(h),
        "mtp.norm.weight": r(h),
        p + "self_attn.q_proj.weight": r(2 * q if cfg.hybrid.attn_output_gate else q, h),
        p + "self_attn.k_proj.weight": r(kv, h),
        p + "self_attn.v_proj.weight": r(kv, h),
        p + "self_attn.o_proj.weight": r(h, q),
        p + "self_attn.q_norm.weight": r(cfg.head_dim),
        p + "self_attn.k_norm.weight": r(cfg.head_dim),
        p + "input_layernorm.weight": r(h),
        p + "post_attention_layernorm.weight": r(h),
    }
    m = cfg.hybrid.moe
    if m is None:
        i = cfg.intermediate_size
        w.update({p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
                  p + "mlp.down_proj.weight": r(h, i)})  # fmt: skip
        return w
    i, s = m.moe_intermediate_size, m.shared_expert_intermediate_size
    w.update({
        p + "mlp.gate.weight": r(m.num_experts, h),
        p + "mlp.experts.gate_up_proj": r(m.num_experts, 2 * i, h),
        p + "mlp.experts.down_proj": r(m.num_experts, h, i),
        p + "mlp.shared_expert.gate_proj.weight": r(s, h),
        p + "mlp.shared_expert.up_proj.weight": r(s, h),
        p + "mlp.shared_expert.down_proj.weight": r(h, s),
        p + "mlp.shared_expert_gate.weight": r(1, h),
    })  # fmt: skip
    return w
