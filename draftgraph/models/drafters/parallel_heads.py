"""Head drafters (EAGLE, EAGLE-3, DeepSeek-style and Qwen3.5 MTP) over a tensor-parallel target.

These heads embed tokens with the target's embedding and draft with its LM head (or their own, when their
checkpoint has them). Tensor parallelism splits those over the vocabulary, so a head runs one of two ways:

- draft TP = TP (`tp` is the target's group): the head is split like the target's layers (attention heads,
  MLP / expert columns, row-parallel outputs all-reduced); it embeds through the target's vocab-parallel
  embedding (an `all_reduce`) and its logits are local vocabulary rows, then `all_gather_last`, the same
  collectives as the target's. Its own embedding / LM head, when it has them, are split the same way (EAGLE-3's
  LM head over its draft vocabulary, which must then divide by TP).
- draft TP = 1 (`tp` is one process): the head is replicated on every rank and its draft loop runs no
  collective. It then needs the FULL embedding and LM head rows: `head_share` gathers the target's
  vocab-parallel shares once at load (one all-gather per tensor, on every rank together) into a copy the
  drafter owns as its own embedding / head. Memory: each rank then holds V x H more elements per gathered
  tensor (two for an untied target, one when tied) besides its V/TP-row shares: for DeepSeek-V3 (V = 129280,
  H = 7168, bf16) that is 1.85 GB per tensor and rank; a head with its own full embedding / head gathers
  nothing for it.

Any other draft TP is refused (`check_draft_group`; CompileConfig refuses it before anything loads).
"""

from __future__ import annotations

from typing import Any

import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.parallel.dense import shard_config, tensor_cut
from draftgraph.models.parallel.shard_cut import Cut, split_cut, take
from draftgraph.ops.collectives.op import ParallelGroup


def check_draft_group(kind: str, target: CausalLM, tp: ParallelGroup) -> None:
    """A head drafter's group must be the target's (split alike) or one process (replicated)."""
    if tp.is_single or tp == target.tp:
        return
    allowed = sorted({1, target.tp.world_size})
    raise ValueError(
        f"a {kind} drafter with draft_tensor_parallel_size={tp.world_size} over a target with "
        f"tensor_parallel_size={target.tp.world_size}: the drafter is either split like the target (the same "
        f"size and group) or replicated on every rank (1); allowed: {allowed}"
    )


def gather_rows(weight: torch.Tensor, tp: ParallelGroup) -> torch.Tensor:
    """The ranks' [V/W, H] vocabulary shares concatenated in rank order -> [V, H] on every rank (a collective:
    every rank calls it at the same point of loading)."""
    return tp.all_gather_last(weight.detach().t().contiguous()).t().contiguous()


def head_cut(
    name: str, shape: tuple[int, ...], vocab_keys: tuple[str, ...], tp: ParallelGroup, cfg: ModelConfig | None
) -> Cut | None:
    """How rank `tp.rank` cuts a head's upstream-named tensor: `vocab_keys` (its own embedding / LM head) by
    vocabulary rows, its decoder-layer tensors by the target family's rules (parallel.tensor_cut), everything
    else (fc, eh_proj, norms, d2t / t2d) whole (None)."""
    if tp.is_single:
        return None
    if name in vocab_keys:
        fix = "use draft_tensor_parallel_size=1 (the head replicated on every rank)"
        return split_cut(name, shape, 0, tp.rank, tp.world_size, fix=fix)
    return tensor_cut(name, shape, tp, cfg)


def shard_head_state(
    state: dict[str, Any], vocab_keys: tuple[str, ...], tp: ParallelGroup, cfg: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """A head's upstream-named tensors cut to rank `tp.rank`'s share (`head_cut`): tensors in memory sliced,
    stored ones (sharded_read.StoredTensor) read as that share only."""
    return {name: take(t, head_cut(name, tuple(t.shape), vocab_keys, tp, cfg)) for name, t in state.items()}


def head_share(
    kind: str,
    cfg: ModelConfig,
    state: dict[str, Any],
    target: CausalLM,
    tp: ParallelGroup,
    borrowed: tuple[str | None, str | None],
    own_vocab: tuple[str, ...] = (),
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """This rank's config and tensors of a head drafter whose full config is `cfg` and whose upstream-named
    (already checked) tensors are `state`: tensors in memory, or stored ones not read yet (a checkpoint
    directory: sharded_read.StoredTensor, only their shapes checked so far), read here as this rank's share.

    `borrowed`: the keys its embedding and LM head take in `state` when it has its own (None: it never owns
    that one). Replicated over a split target (draft TP = 1), the missing ones are filled with the target's
    gathered full rows (`gather_rows`). Split (draft TP = TP), `own_vocab` keys are cut by vocabulary rows
    and the layers by the family's rules (`shard_head_state`)."""
    check_draft_group(kind, target, tp)
    state = dict(state)
    missing = [key for key in borrowed if key is not None and key not in state]
    if tp.is_single and not target.tp.is_single and missing:
        embed_key, head_key = borrowed
        tied = target.lm_head is None
        embed = gather_rows(target.embed_tokens.weight, target.tp) if embed_key in missing or tied else None
        if embed_key in missing:
            state[embed_key] = embed
        if head_key in missing:
            state[head_key] = embed if tied else gather_rows(target.lm_head.weight, target.tp)
    return shard_config(cfg, tp), shard_head_state(state, own_vocab, tp, cfg)
