"""Model families, one small file each (llama.py, deepseek.py, qwen3_5.py), registered in registry.py."""

from draftgraph.models.families.registry import (
    AttentionForm,
    Family,
    MTPHead,
    TensorParallelShare,
    families,
    family_for_type,
    family_named,
    family_of,
    supported_model_types,
)

__all__ = [
    "AttentionForm",
    "Family",
    "MTPHead",
    "TensorParallelShare",
    "families",
    "family_for_type",
    "family_named",
    "family_of",
    "supported_model_types",
]
