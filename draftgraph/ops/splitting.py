"""The one list of ops the compiler splits graphs at, and the piece-boundary op.

Importing this module registers every splitting op (torch.library registration happens once per process,
before any graph naming the ops is traced or loaded): passes read `SPLITTING_OPS` from here only.
"""

from __future__ import annotations

import torch

import draftgraph.ops.attention.op  # noqa: F401  (registers draftgraph::paged_attention)
import draftgraph.ops.linear_attention.op  # noqa: F401  (registers draftgraph::gated_delta_net)
import draftgraph.ops.mla.op  # noqa: F401  (registers draftgraph::mla_attention)
import draftgraph.ops.sparse_mla.op  # noqa: F401  (registers draftgraph::sparse_mla_attention and indexer_topk)
from draftgraph.ops.registry import custom_op

# indexer_topk is deliberately absent: it stays inside the piece before sparse_mla_attention (sparse_mla/op.py).
SPLITTING_OPS: list[str] = [
    "draftgraph::paged_attention",
    "draftgraph::mla_attention",
    "draftgraph::sparse_mla_attention",
    "draftgraph::gated_delta_net",
    "draftgraph::piece_boundary",
]


@custom_op("draftgraph::piece_boundary", mutates_args=("tensors",))
def piece_boundary(tensors: list[torch.Tensor]) -> None:
    """Does nothing to `tensors`: a split point. Around a module call inside a larger traced function (the
    drafter's forward inside the fused draft loop) it makes the call's pieces exactly the module's own, so
    they share its compiled code. Declared as mutating so that no pass drops it; it launches no kernel."""


def mark_piece_boundary(*tensors) -> None:
    """A split point over these tensors while Dynamo traces (eager callers pay nothing)."""
    if torch.compiler.is_compiling():
        piece_boundary([t for t in tensors if t is not None])
