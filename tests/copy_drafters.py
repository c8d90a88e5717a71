"""Drafters in their upstream checkpoint layouts whose weights make them predict "the target's next token
again": their decoder layers add nothing (o_proj and down_proj are zero), and the input projection
passes the target's hidden state through to the target's own head. On a target that repeats itself they
reach real, partial acceptance, so every acceptance path of the engine runs (random heads accept ~never).
"""

from __future__ import annotations

import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from tests import dense_ref
from tests.test_drafters import module_from_state


def _quiet_layer(prefix, cfg, in_features=None, input_norm=True):
    w = dense_ref.random_layer(
        prefix,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        in_features=in_features,
        input_norm=input_norm,
        gen=torch.Generator().manual_seed(7),
    )
    w[prefix + "self_attn.o_proj.weight"].zero_()
    w[prefix + "mlp.down_proj.weight"].zero_()
    return w


def copy_eagle(target: CausalLM):
    h = target.cfg.hidden_size
    w = _quiet_layer("layers.0.", target.cfg, input_norm=False)
    w["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)  # keep the target hidden state
    return load_drafter(module_from_state(w), target, kind="eagle")


def copy_mtp(target: CausalLM):
    h, layer = target.cfg.hidden_size, target.cfg.num_layers
    p = f"model.layers.{layer}."
    w = _quiet_layer(p, target.cfg)
    w[p + "enorm.weight"] = torch.ones(h)
    w[p + "hnorm.weight"] = torch.ones(h)
    w[p + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    w[p + "shared_head.norm.weight"] = torch.ones(h)  # rmsnorm(rmsnorm(h)) keeps the target's argmax
    return load_drafter(module_from_state(w), target, kind="mtp")


def copy_eagle3_state(target: CausalLM, draft_vocab: int | None = None) -> dict:
    """EAGLE-3 weights under upstream names. `draft_vocab` (None: the whole vocabulary): the draft vocabulary is
    that many target ids (a fixed random choice, ascending as upstream's), lm_head the target's rows for them,
    `d2t` their offsets and `t2d` their mask; targets outside it are never drafted (partial acceptance)."""
    h, vocab = target.cfg.hidden_size, target.cfg.vocab_size
    w = _quiet_layer("midlayer.", target.cfg, in_features=2 * h)
    w["midlayer.hidden_norm.weight"] = torch.ones(h)
    w["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)  # the third aux: the last layer
    w["norm.weight"] = target.norm.weight.detach().clone()
    n = draft_vocab or vocab
    kept = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:n].sort().values if draft_vocab else None
    kept = torch.arange(vocab) if kept is None else kept
    w["lm_head.weight"] = target.head_weight.detach()[kept].clone()
    w["d2t"] = kept - torch.arange(n)  # draft id i -> target id i + d2t[i]
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)
    return w


def copy_eagle3(target: CausalLM, draft_vocab: int | None = None):
    w = copy_eagle3_state(target, draft_vocab)
    last = target.cfg.num_layers - 1
    return load_drafter(module_from_state(w), target, kind="eagle3", aux_layers=(0, 1, last))


def make_drafter(kind: str, target: CausalLM):
    from draftgraph.models.drafters.loader import truncated_draft_model

    if kind == "ngram":  # prompt lookup: no model, selected by name (models/drafters/ngram.py)
        return "ngram"
    if kind == "draft_model":
        return truncated_draft_model(target, target.cfg.num_layers - 1)
    if kind == "eagle3_reduced":  # EAGLE-3 over a reduced draft vocabulary (5/8 of the target's, through d2t)
        return copy_eagle3(target, draft_vocab=target.cfg.vocab_size * 5 // 8)
    return {"eagle": copy_eagle, "eagle3": copy_eagle3, "mtp": copy_mtp}[kind](target)


def copy_deepseek_mtp(target: CausalLM):
    """A DeepSeek-V3 MTP layer (MLA + MoE block, hub layout) that repeats the target's prediction."""
    from draftgraph.models.builtin import deepseek_layer_weights

    h, layer = target.cfg.hidden_size, target.cfg.num_layers
    p = f"model.layers.{layer}."
    w = deepseek_layer_weights(p, target.cfg, torch.Generator().manual_seed(7), quiet=True)
    w[p + "enorm.weight"] = torch.ones(h)
    w[p + "hnorm.weight"] = torch.ones(h)
    w[p + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    w[p + "shared_head.norm.weight"] = torch.ones(h)
    return load_drafter(module_from_state(w), target, kind="mtp")
