"""EAGLE-1/2 head: fc(cat(embed(token), target_hidden)) -> decoder layers -> the target's LM head.

Checkpoint layout of the public EAGLE repository: `fc.weight` (+ `fc.bias`), `layers.N.*` with
transformers' decoder-layer names (layer 0 without `input_layernorm`), optional `embed_tokens.weight`
(shared with the target when absent). No final norm: the head predicts the target's normed feature.

Over a tensor-parallel target (drafters/parallel_heads.py): split like it (`tp` the target's group: its layers'
heads and MLP columns, the target's vocab-parallel embedding and LM head) or replicated (`tp` one process:
whole layers, the target's embedding and head gathered once into its own `embed_tokens` / `lm_head`).
"""

from __future__ import annotations

import torch
from torch import nn

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.base import Drafter, mismatch
from draftgraph.models.drafters.parallel_heads import head_share
from draftgraph.models.layers import DecoderLayer, materialize, rope_lookup
from draftgraph.models.linear import Linear, head_logits
from draftgraph.models.parallel.dense import embedding
from draftgraph.models.weights import assign_weights, convert_layer, layer_indices
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


class EagleDrafter(Drafter):
    kind = "eagle"

    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        fc_bias: bool,
        own_embedding: bool,
        attn_impl: str,
        own_head: bool = False,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.ops = ops
        # Own embedding when the checkpoint has one, else the target's (held outside our parameters); own LM
        # head only as the replicated copy of a split target's (vocab-parallel when `tp` splits).
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp) if own_embedding else None
        local_vocab = cfg.vocab_size // tp.world_size
        self.lm_head = nn.Linear(cfg.hidden_size, local_vocab, bias=False) if own_head else None
        assert (own_embedding and own_head) or target.tp == tp, "borrowed rows must be split like the head"
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias, ops=ops)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, attn_impl, input_norm=i != 0, tp=tp, ops=ops) for i in range(cfg.num_layers)
        )
        self._target = [target]  # a list keeps the target out of this module's parameters
        self.register_buffer("rope_table", torch.empty(cfg.max_position_embeddings, cfg.head_dim), persistent=False)

    def forward(self, input_ids, positions, hidden, meta, kv_caches):
        cos, sin = rope_lookup(self.rope_table, positions)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed_tokens
        x = self.fc(torch.cat([embed(input_ids), hidden], dim=-1))  # [T, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv_caches[i])
        return x, x

    def compute_logits(self, hidden, indices=None):
        if indices is not None:
            hidden = hidden[indices]
        weight = self.lm_head.weight if self.lm_head is not None else self._target[0].head_weight
        return self.tp.all_gather_last(head_logits(hidden, weight, self.ops))  # local vocabulary rows -> all of them

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        state: dict,
        target: CausalLM,
        device,
        attn_impl,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ) -> EagleDrafter:
        """`cfg`: the whole head's config (a split target's full shape); `tp`: the target's group or one process."""
        state = {k.removeprefix("model."): v for k, v in state.items()}
        check_pair(cfg, state, target.cfg)
        cfg, state = head_share("eagle", cfg, state, target, tp, ("embed_tokens.weight", "lm_head.weight"),
                                ("embed_tokens.weight", "lm_head.weight"))  # fmt: skip
        layers = layer_indices(state, "layers.")
        cfg = cfg.replace(num_layers=len(layers), sliding_windows=())
        ours = {}
        for i in layers:
            ours.update(convert_layer(state, f"layers.{i}.", f"layers.{i}."))
        ours.update(state)
        with torch.device("meta"):
            model = cls(cfg, target, "fc.bias" in ours, "embed_tokens.weight" in ours, attn_impl,
                        "lm_head.weight" in ours, tp, ops)  # fmt: skip
        assign_weights(model, ours, "EAGLE drafter", cfg.dtype)
        return materialize(model, cfg, device)


def check_pair(cfg: ModelConfig, state: dict, target: ModelConfig) -> None:
    if cfg.hidden_size != target.hidden_size:
        raise mismatch(
            "hidden_size",
            cfg.hidden_size,
            target.hidden_size,
            "an EAGLE head must be trained for this target (it reads the target's hidden states)",
        )
    fc = state.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, 2 * target.hidden_size):
        raise mismatch(
            "fc.weight shape",
            list(fc.shape),
            [cfg.hidden_size, 2 * target.hidden_size],
            "EAGLE's fc maps [embedding; target hidden] (2H) to H",
        )
    emb = state.get("embed_tokens.weight")
    vocab = emb.shape[0] if emb is not None else cfg.vocab_size
    if vocab != target.vocab_size:
        raise mismatch(
            "vocab_size",
            vocab,
            target.vocab_size,
            "EAGLE drafts with the target's LM head, so the vocabularies must agree",
        )
