"""Paged attention: the custom op, its implementations and the metadata it reads."""

from draftgraph.models.attention.backends import BACKENDS, GraphSupport, get_backend
from draftgraph.models.attention.metadata import AttentionMetadata
from draftgraph.models.attention.op import SPLITTING_OPS, paged_attention

__all__ = ["BACKENDS", "GraphSupport", "get_backend", "AttentionMetadata", "SPLITTING_OPS", "paged_attention"]
