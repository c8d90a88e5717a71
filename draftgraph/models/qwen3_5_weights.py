"""Qwen3.5 checkpoints -> our parameter names (models/qwen3_5.py builds the modules).

Key layouts read:
- transformers' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (in memory or saved): `model.layers.N.*`;
- the multimodal checkpoints (`qwen3_5`, `qwen3_5_moe`): `model.language_model.*` for the text model, with
  `model.visual.*` (the vision tower) dropped; `mtp.*` (the MTP head, models/drafters/qwen3_5_mtp.py reads
  it) is dropped from the target's weights.
- experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, transformers 5 in memory) or
  one module per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub's layout).

A Gated DeltaNet layer's four input projections (qkv, z, b, a) become one matmul, `attn.in_proj`; its conv
weight [conv_dim, 1, W] is kept as [conv_dim, W].
"""

from __future__ import annotations

import re

import torch

_FULL = {
    "attn.o.weight": "self_attn.o_proj.weight",
    "attn.o.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
_LINEAR = {
    "attn.A_log": "linear_attn.A_log",
    "attn.dt_bias": "linear_attn.dt_bias",
    "attn.norm.weight": "linear_attn.norm.weight",
    "attn.out_proj.weight": "linear_attn.out_proj.weight",
}
_COMMON = {
    "input_norm.weight": "input_layernorm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate": "mlp.gate.weight",
    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight",
}


# Stored names that are not the text model's: the MTP head and the vision tower (a rank's target read skips them).
NOT_TEXT_MODEL = ("mtp.", "model.visual.", "visual.")


def normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's weights under `model.*` / `lm_head.*` (the multimodal layout's prefix removed, the
    vision tower and the MTP head dropped)."""
    out = {}
    for k, v in state.items():
        if k.startswith(NOT_TEXT_MODEL):
            continue
        out["model." + k[len("model.language_model.") :] if k.startswith("model.language_model.") else k] = v
    return out


def convert_qwen3_5_layer(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One transformers Qwen3.5 decoder layer at prefix `src` -> ours at `dst` (pops from state)."""
    out = {}

    def cat(names: list[str], key: str) -> None:
        parts = [src + n for n in names]
        if all(p in state for p in parts):
            out[dst + key] = torch.cat([state.pop(p) for p in parts], dim=0)
        elif any(p in state for p in parts):
            raise ValueError(f"checkpoint has only some of {parts}")

    la = "linear_attn."
    cat([la + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")], "attn.in_proj.weight")
    if src + la + "conv1d.weight" in state:
        out[dst + "attn.conv_weight"] = state.pop(src + la + "conv1d.weight").squeeze(1)
    sa = "self_attn."
    cat([sa + f"{n}_proj.weight" for n in ("q", "k", "v")], "attn.qkv.weight")
    cat([sa + f"{n}_proj.bias" for n in ("q", "k", "v")], "attn.qkv.bias")
    for rules in (_FULL, _LINEAR, _COMMON):
        for ours, theirs in rules.items():
            if src + theirs in state:
                out[dst + ours] = state.pop(src + theirs)
    for part, name in (("mlp.", "mlp."), ("mlp.shared_expert.", "mlp.shared.")):  # dense MLP, shared expert
        cat([part + "gate_proj.weight", part + "up_proj.weight"], name + "gate_up.weight")
        if src + part + "down_proj.weight" in state:
            out[dst + name + "down.weight"] = state.pop(src + part + "down_proj.weight")
    _experts(state, src, dst, out)
    return out


def _experts(state: dict, src: str, dst: str, out: dict) -> None:
    fused = src + "mlp.experts.gate_up_proj"
    if fused in state:
        out[dst + "mlp.gate_up"] = state.pop(fused)
        out[dst + "mlp.down"] = state.pop(src + "mlp.experts.down_proj")
        return
    pat = re.compile(re.escape(src) + r"mlp\.experts\.(\d+)\.")
    experts = sorted({int(m.group(1)) for k in state if (m := pat.match(k))})
    if not experts:
        return
    gate_up, down = [], []
    for e in experts:
        p = f"{src}mlp.experts.{e}."
        gate_up.append(torch.cat([state.pop(p + "gate_proj.weight"), state.pop(p + "up_proj.weight")], dim=0))
        down.append(state.pop(p + "down_proj.weight"))
    out[dst + "mlp.gate_up"] = torch.stack(gate_up)
    out[dst + "mlp.down"] = torch.stack(down)
