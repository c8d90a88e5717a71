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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: the message names the file, what is wrong and the fix."""


# config.json keys every target needs, each a positive integer.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (from its shard index when it has one)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{index} has no "weight_map" object; re-save the checkpoint')
    files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"{index} lists shards that are missing: {missing[:4]}; download them again")
    return files


def check_weight_files(path: str) -> list[str]:
    """Read each safetensors file's header only (no tensor data): a truncated or corrupt file is named here,
    before any weights are loaded. Returns the files."""
    from safetensors import safe_open

    files = weight_files(path)
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({os.path.getsize(file)} bytes: {e}); it may be "
                "truncated or corrupt: download or save the checkpoint again"
            ) from e
    return files


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by their stored names."""
    from safetensors.torch import load_file

    files = check_weight_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as e:
            raise CheckpointError(f"{file} could not be read ({e}); download or save the checkpoint again") from e
    if not files:
        bin_path = os.path.join(path, "pytorch_model.bin")
        if not os.path.exists(bin_path):
            raise FileNotFoundError(
                f"no weights in {path!r}: expected model.safetensors, a sharded index "
                "(model.safetensors.index.json) or pytorch_model.bin"
            )
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{bin_path} could not be read as a weights-only torch checkpoint ({e}); download it again or "
                "convert the checkpoint to safetensors"
            ) from e
    return state


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory, as a dict (a file that is not a JSON object is named)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        raise FileNotFoundError(f"{path!r} has no config.json")
    return _read_json(cfg)


def read_target_config(path: str) -> dict:
    """config.json of a target checkpoint, checked for the keys every target needs."""
    config = read_config(path)
    file = os.path.join(path, "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config  # Qwen3.5's wrapper
    for key in REQUIRED_KEYS:
        if key == "intermediate_size" and text.get("moe_intermediate_size") is not None:
            continue  # every layer a MoE (qwen3_5_moe): no dense intermediate size
        value = text.get(key)
        if value is None:
            raise CheckpointError(f"{file} has no {key!r}; a target's config.json needs {list(REQUIRED_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{file}: {key}={value!r} must be a positive integer; fix or re-save config.json")
    return config


def _read_json(file: str) -> dict:
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix it or download it again"
        ) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text ({e.reason}); fix it or download it again") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, not an object; fix it or download it again")
    return data


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
    fp32 = _kept_in_fp32(module)
    state = {}
    for k in persistent:
        t = weights[k]
        state[k] = t.to(torch.float32 if k in fp32 else dtype) if t.is_floating_point() else t
    module.load_state_dict(state, strict=False, assign=True)


def _kept_in_fp32(module: nn.Module) -> set[str]:
    """Parameters a module lists in `keep_fp32_params` stay float32 whatever the model's dtype (transformers'
    `_keep_in_fp32_modules`, e.g. DeepSeek-V3.2's indexer.weights_proj)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in getattr(sub, "keep_fp32_params", ())
    }


def _non_persistent(module: nn.Module) -> set[str]:
    names = set()
    for prefix, sub in module.named_modules():
        for b in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{b}" if prefix else b)
    return names
