"""The family registry: what each model family declares, and `family_of(cfg)`, the one place a config's family is
decided. Code elsewhere asks the family (its layer factory, weight names, caches, tensor-parallel share, drafter
heads) instead of testing which optional parts (`mla`, `indexer`, `hybrid`) a ModelConfig carries.

This module imports nothing but the config, so the modules a family is assembled from (layers, tensor-parallel
rules) can ask `family_of` too; the family files themselves are imported on the first lookup.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftgraph.models.config import ModelConfig

# The optional ModelConfig parts whose presence a family fixes (family_of checks the config agrees).
PARTS = ("mla", "indexer", "hybrid")


class AttentionForm(enum.Enum):
    """How a family's layers attend, and so what its paged cache holds per token."""

    PAGED_GQA = "paged_gqa"  # paged MHA / GQA over K and V heads (ops/attention)
    MLA = "mla"  # DeepSeek's latent attention over one latent and RoPE key per token (ops/mla)
    SPARSE_MLA = "sparse_mla"  # MLA over the lightning indexer's top-k tokens, plus its key cache (ops/sparse_mla)
    HYBRID = "hybrid"  # Qwen3.5: Gated DeltaNet layers (recurrent state) and gated full attention (paged GQA)


class MTPHead(enum.Enum):
    """The multi-token-prediction drafter a family's checkpoints carry (drafters/mtp.py, qwen3_5_mtp.py)."""

    OWN_CONFIG = "own_config"  # an upstream head with its own (Llama-shaped) config over the target's sizes
    TARGET_LAYER = "target_layer"  # DeepSeek: `model.layers.{num_layers}`, a layer of the target's own shape
    QWEN3_5 = "qwen3_5"  # Qwen3.5's `mtp.*` head (a gated full-attention layer of its own)


@dataclass(frozen=True)
class TensorParallelShare:
    """How a family splits over tensor-parallel ranks (models/parallel/)."""

    sizes: Callable[[ModelConfig], tuple[tuple[str, int], ...]]  # (name, size) every TP size must divide
    scale: Callable[[ModelConfig, int, bool], ModelConfig]  # (cfg, w, up): one rank's config, or the whole back
    # (name, shape, rank, w, whole cfg) -> Cut of a tensor only this family has, None to fall back to the Llama
    # rules (parallel/dense.py); None when the family has no tensor of its own
    cut: Callable[[str, tuple[int, ...], int, int, ModelConfig], Any] | None = None


@dataclass(frozen=True)
class Family:
    """A model family: the configs it claims and everything the shared code asks of it."""

    name: str
    model_types: tuple[str, ...]  # the transformers model_type values it claims
    parts: tuple[str, ...]  # which of PARTS its configs carry (the others are None)
    attention: AttentionForm
    make_layer: Callable[..., Any]  # (cfg, layer index, attn_impl, tp, ops) -> this rank's decoder layer
    convert_layer: Callable[[dict, str, str], dict]  # (state, src prefix, dst prefix): transformers names -> ours
    share: TensorParallelShare
    mtp: MTPHead
    zero_centered_norm: bool = False  # the final norm computes x * (1 + w) (Qwen3.5)
    # transformers-named state dict -> the text model's keys (Qwen3.5's multimodal layout); None: as stored
    normalize_keys: Callable[[dict], dict] | None = None
    foreign_prefixes: tuple[str, ...] = ()  # stored tensor names that are not the target's (MTP head, vision)
    # Caches: the layers that keep recurrent state (runtime/state_cache.py) instead of paged KV
    state_layers: Callable[[ModelConfig], tuple[int, ...]] = lambda cfg: ()
    # The routed-expert block's config (expert parallelism), None for a dense family
    experts: Callable[[ModelConfig], Any] = lambda cfg: None

    def __post_init__(self):
        bad = sorted(set(self.parts) - set(PARTS))
        if bad:
            raise ValueError(f"family {self.name!r} declares parts {bad}; allowed: {list(PARTS)}")

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a config whose optional parts disagree with this family's (a hand-made or edited config)."""
        for part in PARTS:
            has = getattr(cfg, part) is not None
            if has != (part in self.parts):
                raise ValueError(
                    f"model_type={cfg.model_type!r} is the {self.name} family, whose configs "
                    f"{'carry' if part in self.parts else 'have no'} `{part}`, but this ModelConfig "
                    f"{'has one' if has else 'has none'}; build it with ModelConfig.from_hf, or change model_type "
                    "together with the part"
                )


@functools.cache
def _registry() -> dict[str, Family]:
    # Imported here, not at the top: the family files import the layers and tensor-parallel rules, which
    # themselves ask family_of (the lookup runs after every module has loaded).
    from draftgraph.models.families import deepseek, llama, qwen3_5

    families = (llama.LLAMA, deepseek.DEEPSEEK_V3, deepseek.DEEPSEEK_V32, qwen3_5.QWEN3_5)
    claimed: dict[str, str] = {}
    for family in families:
        for model_type in family.model_types:
            assert model_type not in claimed, f"{model_type} claimed by {claimed[model_type]} and {family.name}"
            claimed[model_type] = family.name
    return {family.name: family for family in families}


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_registry().values())


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for family in families() for t in family.model_types))


def family_named(name: str) -> Family:
    registry = _registry()
    if name not in registry:
        raise ValueError(f"model family {name!r} is not registered; registered: {sorted(registry)}")
    return registry[name]


def family_for_type(model_type: str) -> Family:
    """The family that claims a transformers model_type."""
    for family in families():
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"model_type={model_type!r} is not supported; supported: {list(supported_model_types())}. "
        "Each is claimed by one family in draftgraph/models/families/."
    )


def family_of(cfg: ModelConfig) -> Family:
    """The family of a ModelConfig (by its model_type), checked against the parts the config carries."""
    family = family_for_type(cfg.model_type)
    family.check(cfg)
    return family
