"""EAGLE-3 head: three target layers fused by fc (3H -> H), one layer over [norm(emb); norm(hidden)].

Checkpoint layout of the public EAGLE repository: `fc.weight`, `midlayer.*` (transformers names plus
`hidden_norm`; its q/k/v projections take 2H inputs), `norm.weight`, `lm_head.weight` over a draft
vocabulary, `d2t` (draft id -> target id offset) and `t2d`, optional `embed_tokens.weight`.
Step 1 reads the target's fused aux hidden states [T, 3H]; later steps feed back their own [T, H].

Over a tensor-parallel target (drafters/parallel_heads.py): split like it (the midlayer's heads and MLP
columns, its LM head over draft-vocabulary rows then all-gathered, the target's vocab-parallel embedding) or
replicated (whole, the target's embedding gathered once into its own `embed_tokens`).
"""

from __future__ import annotations

import torch
from torch import nn

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.base import Drafter, mismatch
from draftgraph.models.drafters.parallel_heads import head_share
from draftgraph.models.layers import MLP, Attention, RMSNorm, materialize, rope_lookup
from draftgraph.models.linear import Linear
from draftgraph.models.parallel.dense import embedding
from draftgraph.models.parallel.shard_cut import take
from draftgraph.models.weights import assign_weights, convert_layer
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """Outputs of layers (1, L/2 - 1, L - 4) as upstream EAGLE-3 captures them, clamped to the model."""
    last = num_target_layers - 1
    return tuple(min(max(i, 0), last) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.attn = Attention(cfg, 0, attn_impl, in_features=2 * cfg.hidden_size, tp=tp, ops=ops)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.mlp = MLP(cfg, tp=tp, ops=ops)

    def forward(self, emb, hidden, cos, sin, meta, kv):
        x = torch.cat([self.input_norm(emb), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h = hidden + self.attn(x, cos, sin, meta, kv)
        return h + self.mlp(self.post_norm(h))


class Eagle3Drafter(Drafter):
    kind = "eagle3"

    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        draft_vocab: int,
        aux_layers: tuple[int, ...],
        own_embedding: bool,
        attn_impl: str,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.ops = ops
        self._aux_layers = aux_layers
        self._draft_vocab = draft_vocab
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp) if own_embedding else None
        assert own_embedding or target.tp == tp, "a borrowed embedding must be split like the head"
        self.fc = Linear(3 * target.cfg.hidden_size, cfg.hidden_size, bias=False, ops=ops)
        self.midlayer = Eagle3Layer(cfg, attn_impl, tp, ops)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ops)
        self.lm_head = Linear(cfg.hidden_size, draft_vocab // tp.world_size, bias=False, ops=ops)  # local draft rows
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(target.cfg.vocab_size, dtype=torch.bool))
        self._target = [target]
        self.register_buffer("rope_table", torch.empty(cfg.max_position_embeddings, cfg.head_dim), persistent=False)

    @property
    def target_hidden(self) -> str:
        return "aux"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self._aux_layers

    @property
    def num_kv_layers(self) -> int:
        return 1

    @property
    def draft_vocab_size(self) -> int:
        return self._draft_vocab

    def forward(self, input_ids, positions, hidden, meta, kv_caches):
        cos, sin = rope_lookup(self.rope_table, positions)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed_tokens
        if hidden.shape[-1] != self.cfg.hidden_size:  # first step: fuse the target's three layers
            hidden = self.fc(hidden)  # [T, 3H] -> [T, H]
        out = self.midlayer(embed(input_ids), hidden, cos, sin, meta, kv_caches[0])
        return out, self.norm(out)

    def compute_logits(self, hidden, indices=None):
        if indices is not None:
            hidden = hidden[indices]
        return self.tp.all_gather_last(self.lm_head(hidden))  # [N, draft_vocab]

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def draft_probs_to_target(self, probs, target_vocab):
        out = probs.new_zeros(probs.shape[0], target_vocab)
        ids = torch.arange(probs.shape[1], device=probs.device)
        return out.index_copy_(1, self.to_target_ids(ids), probs)

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        state: dict,
        target: CausalLM,
        device,
        attn_impl,
        aux_layers: tuple[int, ...] | None = None,
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
        declared_draft_vocab: int | None = None,
    ) -> Eagle3Drafter:
        """`cfg`: the whole head's config (a split target's full shape); `tp`: the target's group or one process;
        `declared_draft_vocab`: config.json's `draft_vocab_size`, when it has one."""
        state = {k.removeprefix("model."): v for k, v in state.items()}
        for name in ("d2t", "t2d"):  # their values are checked: read now if still stored (replicated, small)
            if name in state:
                state[name] = take(state[name], None)
        draft_vocab = check_pair(cfg, state, target.cfg, declared_draft_vocab)
        cfg, state = head_share("eagle3", cfg, state, target, tp, ("embed_tokens.weight", None),
                                ("embed_tokens.weight", "lm_head.weight"))  # fmt: skip
        ours = convert_layer(state, "midlayer.", "midlayer.")
        ours.update(state)  # fc, norm, lm_head, d2t, t2d, embed_tokens, midlayer.hidden_norm
        cfg = cfg.replace(num_layers=1, sliding_windows=())
        aux = aux_layers or default_aux_layers(target.cfg.num_layers)
        with torch.device("meta"):
            model = cls(cfg, target, draft_vocab, aux, "embed_tokens.weight" in ours, attn_impl, tp, ops)
        assign_weights(model, ours, "EAGLE-3 drafter", cfg.dtype)
        return materialize(model, cfg, device)


def check_pair(cfg: ModelConfig, state: dict, target: ModelConfig, declared: int | None = None) -> int:
    """The draft vocabulary size of an EAGLE-3 checkpoint, after checking its layout against the target:
    fc reads three target layers, lm_head has one row per d2t entry (and `declared`, config.json's
    draft_vocab_size, when given), d2t lands inside the target's vocabulary, t2d marks exactly those ids."""
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError("EAGLE-3 checkpoint has no fc.weight (expected [hidden, 3 * target_hidden])")
    if fc.shape[1] != 3 * target.hidden_size:
        raise mismatch(
            "fc input features (3 x target hidden)",
            fc.shape[1],
            3 * target.hidden_size,
            "this EAGLE-3 head was trained for a target of another hidden size",
        )
    head = state.get("lm_head.weight")
    d2t = state.get("d2t")
    if head is None or d2t is None:
        raise ValueError("EAGLE-3 checkpoint needs lm_head.weight and d2t (draft -> target vocabulary map)")
    if head.shape[0] != d2t.shape[0]:
        raise ValueError(
            f"EAGLE-3 head layout: lm_head has {head.shape[0]} rows but d2t maps {d2t.shape[0]} draft "
            "tokens; they must agree (draft_vocab_size)"
        )
    if declared is not None and declared != head.shape[0]:
        raise ValueError(
            f"EAGLE-3 checkpoint: config.json has draft_vocab_size={declared} but lm_head.weight and d2t have "
            f"{head.shape[0]} draft tokens; fix draft_vocab_size or use the weights it was written with"
        )
    ids = torch.arange(d2t.shape[0]) + d2t.cpu().long()  # draft id i -> target id i + d2t[i] (checked on the host)
    top = int(ids.max()) if d2t.numel() else -1
    if top >= target.vocab_size or (d2t.numel() and int(ids.min()) < 0):
        raise mismatch(
            "largest target id reached through d2t",
            f"{top} (smallest {int(ids.min())})",
            f"vocab_size={target.vocab_size}",
            "the draft vocabulary map was built for another tokenizer",
        )
    t2d = state.get("t2d")
    if t2d is not None:  # upstream's mask over the target vocabulary: True exactly at the ids d2t reaches
        marked = t2d.cpu().bool()
        if marked.shape[0] != target.vocab_size or int(marked.sum()) != ids.unique().numel() or not marked[ids].all():
            raise ValueError(
                f"EAGLE-3 t2d marks {int(marked.sum())} of {marked.shape[0]} target ids, but d2t reaches "
                f"{ids.unique().numel()} ids of a {target.vocab_size}-token vocabulary; t2d must be True exactly "
                "at the target ids of the draft vocabulary (draft id i -> target id i + d2t[i])"
            )
    emb = state.get("embed_tokens.weight")
    if emb is not None and emb.shape[0] != target.vocab_size:
        raise mismatch("embedding vocab_size", emb.shape[0], target.vocab_size, "use the target's tokenizer")
    return head.shape[0]
