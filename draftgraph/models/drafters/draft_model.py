"""An independent small draft model of the target's family: tokens in, its own KV cache."""

from __future__ import annotations

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.base import Drafter, mismatch


class DraftModelDrafter(Drafter):
    kind = "draft_model"

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        self.ops = model.ops

    @property
    def target_hidden(self) -> str:
        return "none"

    def forward(self, input_ids, positions, hidden, meta, kv_caches):
        h, _ = self.model(input_ids, positions, meta, kv_caches)
        return h, h

    def compute_logits(self, hidden, indices=None):
        return self.model.compute_logits(hidden, indices)


def check_pair(draft: CausalLM, target: CausalLM) -> None:
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise mismatch(
            "vocab_size", draft.cfg.vocab_size, target.cfg.vocab_size, "a draft model must share the target's tokenizer"
        )
    rows = draft.head_weight.shape[0] * draft.tp.world_size  # a tensor-parallel head holds V / tp rows
    if rows != target.cfg.vocab_size:
        raise mismatch(
            "LM head rows (head layout)",
            rows,
            target.cfg.vocab_size,
            "a draft model must predict over the target's vocabulary",
        )
