"""Load any drafter kind from a checkpoint directory or from modules in memory, and validate the pair."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.base import KINDS, Drafter
from draftgraph.models.drafters.draft_model import DraftModelDrafter
from draftgraph.models.drafters.draft_model import check_pair as check_draft_pair
from draftgraph.models.drafters.eagle import EagleDrafter
from draftgraph.models.drafters.eagle3 import Eagle3Drafter
from draftgraph.models.drafters.mtp import MTPDrafter
from draftgraph.models.drafters.parallel_heads import check_draft_group
from draftgraph.models.families import MTPHead, family_of
from draftgraph.models.parallel.dense import full_config, shard_config
from draftgraph.models.parallel.sharded_read import model_share, open_checkpoint
from draftgraph.models.weights import read_config, read_target_config
from draftgraph.ops.choices import OpChoices, check_op_choices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


def detect_kind(config: dict, keys) -> str:
    """The drafter kind a checkpoint holds, from its key names (and config for MTP)."""
    keys = [k.removeprefix("model.") for k in keys]
    if "mtp.fc.weight" in keys:  # Qwen3.5's head (drafters/qwen3_5_mtp.py)
        return "mtp"
    if "d2t" in keys or any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if any(k.endswith("eh_proj.weight") for k in keys):
        return "mtp"
    if "fc.weight" in keys:
        return "eagle"
    if any(k.startswith("layers.") for k in keys) and "lm_head.weight" in keys or config.get("tie_word_embeddings"):
        return "draft_model"
    raise ValueError(
        f"cannot tell the drafter kind from this checkpoint (first keys: {sorted(keys)[:5]}); pass kind= one of "
        f"{list(KINDS)}"
    )


def load_drafter(
    source: Any,
    target: CausalLM,
    kind: str | None = None,
    device=None,
    attn_impl: str | None = None,
    dtype: torch.dtype | None = None,
    aux_layers: tuple[int, ...] | None = None,
    tp: ParallelGroup = SINGLE,
    ops: OpChoices | None = None,
) -> Drafter:
    """`source`: a checkpoint dir, a Drafter, a draftgraph CausalLM, a transformers model object, or any
    module whose state_dict uses the upstream key names (EAGLE, EAGLE-3, DeepSeek MTP layer).

    Tensor parallelism: `tp` is the drafter's group (the target's, or one process: replicated). Draft models
    load their share (from a checkpoint dir or a transformers object) or the whole model replicated. Heads
    (EAGLE, EAGLE-3, MTP) over a split target are split like it, or replicated with the target's embedding
    and LM head gathered once (drafters/parallel_heads.py). From a safetensors checkpoint each rank reads
    only its share of the tensors the drafter keeps (models/parallel/sharded_read.py).

    `ops`: the kernels the drafter's layers use (ops/choices.py); None = the target's. A drafter passed in
    built must have been built with them."""
    device = device if device is not None else target.embed_tokens.weight.device
    attn_impl = attn_impl or target.layers[0].attn.attn_impl
    dtype = dtype or target.cfg.dtype
    ops = ops or target.ops
    if kind is not None and kind not in KINDS:
        raise ValueError(f"drafter kind {kind!r} is unknown; choose one of {list(KINDS)}")
    if isinstance(source, (Drafter, CausalLM)):
        check_op_choices(source, ops, "the drafter")
    if isinstance(source, Drafter):
        return source
    if isinstance(source, CausalLM):
        if tp.world_size > 1 and source.tp.world_size != tp.world_size:
            raise ValueError(
                f"a draftgraph CausalLM drafter cannot be split over draft_tensor_parallel_size={tp.world_size} here; "
                "pass its checkpoint directory or transformers model, or draft_tensor_parallel_size=1 (replicated)"
            )
        check_draft_pair(source, target)
        return DraftModelDrafter(source)
    if isinstance(source, str):  # stored tensors: each read (as this rank's share) only where it is kept
        with open_checkpoint(source, tp, "drafter", device) as state:  # (onto a CUDA device: read straight there)
            return _from_state(source, read_config(source), state, target, kind, device, attn_impl, dtype,
                               aux_layers, tp, ops)  # fmt: skip
    if not isinstance(source, nn.Module):
        raise TypeError(f"drafter source of type {type(source).__name__} is not a path, a module or a Drafter")
    config = _config_dict(getattr(source, "config", None))
    return _from_state(source, config, source.state_dict(), target, kind, device, attn_impl, dtype, aux_layers, tp, ops)


def _from_state(
    source, config: dict, state: dict, target, kind, device, attn_impl, dtype, aux_layers, tp, ops: OpChoices
) -> Drafter:
    """A drafter of upstream-named `state` (tensors, or sharded_read.StoredTensors of an open checkpoint)."""
    kind = kind or detect_kind(config, state.keys())
    if kind != "draft_model":
        check_draft_group(kind, target, tp)  # before any weight is cut or gathered
    if kind == "draft_model":
        if isinstance(source, str):
            config = read_target_config(source)  # a whole model: every key a target needs
        cfg = ModelConfig.from_hf(config, dtype=dtype)
        shard_config(cfg, tp)  # sizes tp cannot split are refused before anything is read
        share = model_share(state, cfg, tp)  # this rank's share (read now when stored)
        draft = CausalLM.from_state_dict(cfg, share, device, attn_impl, tp, sharded=True, ops=ops)
        check_draft_pair(draft, target)
        return DraftModelDrafter(draft)
    mtp = family_of(target.cfg).mtp
    if kind == "mtp" and mtp is MTPHead.QWEN3_5:  # Qwen3.5: its `mtp.*` head
        from draftgraph.models.drafters.qwen3_5_mtp import Qwen3_5MTPDrafter

        return Qwen3_5MTPDrafter.from_state_dict(state, target, device, attn_impl, dtype, tp, ops)
    full = full_config(target.cfg)  # a split target's whole shape: heads take their share of it
    if kind == "mtp" and mtp is MTPHead.TARGET_LAYER:  # DeepSeek-V3: the MTP layer has the target's shape
        return MTPDrafter.from_state_dict(full.replace(dtype=dtype), state, target, device, attn_impl, tp=tp, ops=ops)
    cfg = drafter_config(config, full, dtype)
    if kind == "eagle":
        return EagleDrafter.from_state_dict(cfg, state, target, device, attn_impl, tp, ops)
    if kind == "eagle3":  # config.json's draft_vocab_size (the published key) must match its lm_head and d2t
        declared = config.get("draft_vocab_size")
        return Eagle3Drafter.from_state_dict(cfg, state, target, device, attn_impl, aux_layers, tp, ops, declared)
    return MTPDrafter.from_state_dict(cfg, state, target, device, attn_impl, tp=tp, ops=ops)


def drafter_config(config: dict, target: ModelConfig, dtype) -> ModelConfig:
    """An EAGLE/MTP head's decoder shape: its config.json over the target's (upstream heads are Llama)."""
    merged = {k: v for k, v in config.items() if v is not None}
    merged.setdefault("model_type", "llama")
    if merged["model_type"] not in ("llama", "qwen2", "qwen3", "mistral"):
        merged["model_type"] = "llama"
    for key, value in (
        ("vocab_size", target.vocab_size),
        ("hidden_size", target.hidden_size),
        ("intermediate_size", target.intermediate_size),
        ("num_attention_heads", target.num_heads),
        ("num_key_value_heads", target.num_kv_heads),
        ("num_hidden_layers", 1),
        ("rms_norm_eps", target.rms_norm_eps),
        ("max_position_embeddings", target.max_position_embeddings),
    ):
        merged.setdefault(key, value)
    if "rope_parameters" not in merged and "rope_theta" not in merged and "rope_scaling" not in merged:
        merged["rope_parameters"] = {"rope_type": target.rope.rope_type, "rope_theta": target.rope.theta}
    # Published heads declare their training length (EAGLE-3 for Llama-3.1-8B: 2048) but draft at every position
    # the target reaches: the head's RoPE table must cover the target's (its frequencies do not depend on it).
    merged["max_position_embeddings"] = max(merged["max_position_embeddings"], target.max_position_embeddings)
    return ModelConfig.from_hf(merged, dtype=dtype)


def truncated_draft_model(target: CausalLM, num_layers: int) -> DraftModelDrafter:
    """The built-in drafter: the target's first `num_layers` layers with its embedding, norm and head
    (shared tensors, no copies). Agrees with the target often enough for real acceptance in demos."""
    if not 1 <= num_layers <= target.cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} must lie in [1, {target.cfg.num_layers}] for this target")
    cfg = target.cfg.first_layers(num_layers)
    with torch.device("meta"):
        draft = CausalLM(cfg, target.layers[0].attn.attn_impl, ops=target.ops)
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(list(target.layers[:num_layers]))
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    draft.rope_table = target.rope_table
    return DraftModelDrafter(draft)


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))
