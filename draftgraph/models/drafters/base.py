"""The drafter interface every kind implements (EAGLE, EAGLE-3, MTP, independent draft model)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from draftgraph.models.config import ModelConfig
from draftgraph.ops.attention.metadata import AttentionMetadata

KINDS = ("eagle", "eagle3", "mtp", "draft_model")


class Drafter(nn.Module, ABC):
    """One draft step over the flat token layout.

    forward(input_ids[T], positions[T], hidden[T, Hin] | None, meta, kv_caches) returns
    (next_hidden [T, H], logits_hidden [T, H]): `next_hidden` is fed back as `hidden` at the next
    draft step; `compute_logits(logits_hidden, rows)` gives draft logits over `draft_vocab_size`,
    and `to_target_ids` maps their argmax into the target's vocabulary.
    """

    kind: str
    cfg: ModelConfig  # the drafter's own decoder shape (its KV cache follows it)

    @property
    def target_hidden(self) -> str:
        """What the drafter reads from the target: 'final' (normed last hidden), 'aux' or 'none'."""
        return "final"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (target_hidden == 'aux')."""
        return ()

    @property
    def num_kv_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.vocab_size

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def draft_probs_to_target(self, probs: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """[N, draft_vocab] probabilities -> [N, target_vocab] (identity when the vocabularies agree)."""
        return probs


def mismatch(what: str, drafter_value, target_value, fix: str) -> ValueError:
    return ValueError(
        f"drafter/target mismatch: {what} is {drafter_value} in the drafter but {target_value} in the target; {fix}"
    )
