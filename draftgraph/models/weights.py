"""Checkpoint reading and the transformers -> draftgraph parameter-name mapping.

Reads a local directory (config.json + `model.safetensors`, sharded safetensors with an index, or
`pytorch_model.bin`), renames transformers' keys to ours (fusing q/k/v and gate/up), and assigns the
tensors into a module built on the meta device, checking every shape against the config.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import torch
from torch import nn

# transformers decoder-layer suffixes -> ours. Lists are fused by concatenation along dim 0.
LAYER_RULES: dict[str, str | list[str]] = {
    "attn.qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "attn.o.weight": "self_attn.o_proj.weight",
    "attn.o.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.gate_up.bias": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
    "mlp.down.weight": "mlp.down_proj.weight",
    "mlp.down.bias": "mlp.down_proj.bias",
    "input_norm.weight": "input_layernorm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
}

# Keys some checkpoints carry that hold nothing a model needs.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by their stored names."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    if not files:
        bin_path = os.path.join(path, "pytorch_model.bin")
        if not os.path.exists(bin_path):
            raise FileNotFoundError(
                f"no weights in {path!r}: expected model.safetensors, a sharded index "
                "(model.safetensors.index.json) or pytorch_model.bin"
            )
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    return state


def read_config(path: str) -> dict:
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg) as f:
        return json.load(f)


def convert_layer(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """Rename one transformers decoder layer at prefix `src` to ours at prefix `dst` (pops from state)."""
    out = {}
    for ours, theirs in LAYER_RULES.items():
        if isinstance(theirs, list):
            parts = [state.pop(src + t) for t in theirs if src + t in state]
            if parts:
                if len(parts) != len(theirs):
                    raise ValueError(f"checkpoint has only some of {[src + t for t in theirs]}")
                out[dst + ours] = torch.cat(parts, dim=0)
        elif src + theirs in state:
            out[dst + ours] = state.pop(src + theirs)
    return out


def layer_indices(state: Iterable[str], prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in state if (m := pat.match(k))})


def assign_weights(module: nn.Module, weights: dict[str, torch.Tensor], what: str, dtype: torch.dtype) -> None:
    """Assign `weights` into `module` (built on the meta device), refusing any gap or shape mismatch."""
    expected = dict(module.named_parameters())
    expected.update(dict(module.named_buffers()))
    persistent = {k for k in expected if k not in _non_persistent(module)}
    missing = sorted(persistent - weights.keys())
    unexpected = sorted(k for k in weights.keys() - expected.keys() if not IGNORED.search(k))
    if missing or unexpected:
        raise ValueError(
            f"{what}: checkpoint does not match the model built from its config. "
            f"missing={missing[:8]}{'...' if len(missing) > 8 else ''} "
            f"unexpected={unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name in (n for n in expected if n in persistent):  # module order: the first mismatch is reported
        want, got = tuple(expected[name].shape), tuple(weights[name].shape)
        if want != got:
            raise ValueError(
                f"{what}: {name} has shape {list(got)} in the checkpoint but the config implies {list(want)}; "
                "check hidden_size, num_attention_heads, num_key_value_heads, head_dim and vocab_size"
            )
    state = {}
    for k in persistent:
        t = weights[k]
        state[k] = t.to(dtype) if t.is_floating_point() else t
    module.load_state_dict(state, strict=False, assign=True)


def _non_persistent(module: nn.Module) -> set[str]:
    names = set()
    for prefix, sub in module.named_modules():
        for b in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{b}" if prefix else b)
    return names
