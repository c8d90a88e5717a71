"""torch.compile of the target forward and the drafter step through the piecewise backend.

Every call marks the batch dimensions as unbacked (token dim "tokens", request dim "reqs"), so the one
Dynamo trace has no size guards and no 0/1 specialization: changing the batch size never re-traces.
Marks go on the tensors actually passed (each call builds fresh views), which is what Dynamo reads.
"""

from __future__ import annotations

import torch
from torch._dynamo.decorators import mark_unbacked

from draftgraph.compiler.piecewise import PiecewiseBackend
from draftgraph.models.attention.metadata import AttentionMetadata


def mark_batch_dims(input_ids, positions, meta: AttentionMetadata, hidden=None) -> None:
    for t in (input_ids, positions, meta.slot_mapping, meta.token_req, meta.token_kv_len, hidden):
        if t is not None:
            mark_unbacked(t, 0, shape_id="tokens")
    mark_unbacked(meta.block_tables, 0, shape_id="reqs")
    mark_unbacked(meta.seq_lens, 0, shape_id="reqs")
    mark_unbacked(meta.query_start_loc, 0, shape_id="reqs_plus_one")


class CompiledTarget:
    """Calls like CausalLM.forward(input_ids, positions, meta, kv_caches, aux_layers)."""

    def __init__(self, model, backend: PiecewiseBackend):
        self.model, self.backend = model, backend
        self.fn = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)

    def __call__(self, input_ids, positions, meta, kv_caches, aux_layers=()):
        mark_batch_dims(input_ids, positions, meta)
        return self.fn(input_ids, positions, meta, kv_caches, aux_layers)


class CompiledDrafter:
    """Calls like Drafter.forward(input_ids, positions, hidden, meta, kv_caches)."""

    def __init__(self, drafter, backend: PiecewiseBackend):
        self.drafter, self.backend = drafter, backend
        self.fn = torch.compile(drafter.forward, backend=backend, fullgraph=True, dynamic=False)

    def __call__(self, input_ids, positions, hidden, meta, kv_caches):
        mark_batch_dims(input_ids, positions, meta, hidden)
        return self.fn(input_ids, positions, hidden, meta, kv_caches)
