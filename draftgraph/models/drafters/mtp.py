"""DeepSeek-V3-style multi-token-prediction (MTP) drafter, reused for every draft step.

h' = block(eh_proj(cat(enorm(embed(token)), hnorm(hidden)))); logits = head(shared_head.norm(h')).
Checkpoint layout (DeepSeek-V3): the layer after the decoder, `model.layers.{L}.*` with L =
num_hidden_layers: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, optional `shared_head.head` and
`embed_tokens` (the target's are used when absent: they are shared), and the block's own
transformers-named attention/MLP/norm weights. For a DeepSeek-V3 target the block is a DeepSeek layer
(MLA, MoE with the hub's per-expert or transformers' fused expert layout), shaped by the target's config.

Over a tensor-parallel target (drafters/parallel_heads.py): split like it (the block's heads and MLP / expert
columns; the target's vocab-parallel embedding and head, or its own cut by vocabulary rows) or replicated
(the whole block; the target's embedding and head gathered once into its own `embed_tokens` / `head`).
"""

from __future__ import annotations

import torch
from torch import nn

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.base import Drafter, mismatch
from draftgraph.models.drafters.parallel_heads import head_share
from draftgraph.models.families import MTPHead, family_of
from draftgraph.models.layers import RMSNorm, materialize, rope_lookup
from draftgraph.models.parallel.dense import embedding, full_config
from draftgraph.models.weights import assign_weights, layer_indices
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        own_embedding: bool,
        own_head: bool,
        attn_impl: str,
        layer: int = 0,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.ops = ops
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        # DeepSeek: MLA + MoE (the layer index past the dense ones)
        self.block = family_of(cfg).make_layer(cfg, layer, attn_impl, tp, ops)
        self.head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp) if own_embedding else None
        local_vocab = cfg.vocab_size // tp.world_size
        self.head = nn.Linear(cfg.hidden_size, local_vocab, bias=False) if own_head else None
        assert (own_embedding and own_head) or target.tp == tp, "borrowed rows must be split like the head"
        self._target = [target]
        self.register_buffer("rope_table", torch.empty(cfg.max_position_embeddings, cfg.head_dim), persistent=False)

    @property
    def num_kv_layers(self) -> int:
        return 1

    def forward(self, input_ids, positions, hidden, meta, kv_caches):
        cos, sin = rope_lookup(self.rope_table, positions)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed_tokens
        x = self.eh_proj(torch.cat([self.enorm(embed(input_ids)), self.hnorm(hidden)], dim=-1))  # [T, H]
        out = self.block(x, cos, sin, meta, kv_caches[0])
        return out, self.head_norm(out)

    def compute_logits(self, hidden, indices=None):
        if indices is not None:
            hidden = hidden[indices]
        weight = self.head.weight if self.head is not None else self._target[0].head_weight
        return self.tp.all_gather_last(hidden @ weight.t())  # local vocabulary rows -> all of them

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        state: dict,
        target: CausalLM,
        device,
        attn_impl,
        layer: int | None = None,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ) -> MTPDrafter:
        """`state` is a whole checkpoint (the MTP layer is picked out) or just the layer's weights. `cfg`: the
        whole block's config (a split target's full shape); `tp`: the target's group or one process."""
        if layer is None:
            present = [i for i in layer_indices(state, "model.layers.") if f"model.layers.{i}.eh_proj.weight" in state]
            if not present and "eh_proj.weight" not in state:
                raise ValueError(
                    "no MTP layer found: expected model.layers.{num_hidden_layers}.eh_proj.weight "
                    "(DeepSeek-V3 layout) or a bare layer's eh_proj.weight"
                )
            layer = present[0] if present else None
        prefix = f"model.layers.{layer}." if layer is not None else ""
        mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        target_layer = family_of(target.cfg).mtp is MTPHead.TARGET_LAYER
        if target_layer:  # DeepSeek-V3: the MTP layer is a layer of the target's own shape
            cfg = full_config(target.cfg).replace(dtype=cfg.dtype)
        check_pair(cfg, mine, target.cfg)
        cfg, mine = head_share("mtp", cfg, mine, target, tp, ("embed_tokens.weight", "shared_head.head.weight"),
                               ("embed_tokens.weight", "shared_head.head.weight"))  # fmt: skip
        ours = family_of(cfg).convert_layer(mine, "", "block.")
        for theirs, name in (
            ("enorm.weight", "enorm.weight"),
            ("hnorm.weight", "hnorm.weight"),
            ("eh_proj.weight", "eh_proj.weight"),
            ("shared_head.norm.weight", "head_norm.weight"),
            ("shared_head.head.weight", "head.weight"),
            ("embed_tokens.weight", "embed_tokens.weight"),
        ):
            if theirs in mine:
                ours[name] = mine.pop(theirs)
        ours.update(mine)
        index = cfg.num_layers if target_layer else 0  # past first_k_dense_replace: a MoE block
        cfg = cfg.replace(num_layers=1, sliding_windows=())
        with torch.device("meta"):
            model = cls(cfg, target, "embed_tokens.weight" in ours, "head.weight" in ours, attn_impl, index, tp, ops)
        assign_weights(model, ours, "MTP drafter", cfg.dtype)
        return materialize(model, cfg, device)


def check_pair(cfg: ModelConfig, mine: dict, target: ModelConfig) -> None:
    if cfg.hidden_size != target.hidden_size:
        raise mismatch(
            "hidden_size",
            cfg.hidden_size,
            target.hidden_size,
            "an MTP layer shares the target's embedding and head, so the sizes must agree",
        )
    for key in ("embed_tokens.weight", "shared_head.head.weight"):
        t = mine.get(key)
        if t is not None and tuple(t.shape) != (target.vocab_size, target.hidden_size):
            raise mismatch(
                f"{key} shape (head layout)",
                list(t.shape),
                [target.vocab_size, target.hidden_size],
                "the MTP layer must come from this target's checkpoint",
            )
