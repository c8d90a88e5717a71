"""Run the target forward, the drafter step and the fused draft loop for a `Dispatch`: a whole-forward
CUDA graph (through the engine's `CudaGraphs`), or the function itself (compiled with its piece graphs, or
eager) at the dispatch's padded size. Every call counts one hit for the graph that ran, or "none"
(`engine.stats()["dispatch"]`); in a graph mode, a call without a graph is also a fallback, counted by its
dispatch key (`engine.stats()["fallbacks_by_key"]`)."""

from __future__ import annotations

from collections import Counter

from draftgraph.compiler.cuda_graphs import CudaGraphs, GraphKey
from draftgraph.models.attention.metadata import META_FIELDS, AttentionMetadata
from draftgraph.runtime.dispatcher import Dispatch


def _flat(ids, positions, meta: AttentionMetadata, hidden=None) -> dict:
    out = {"ids": ids, "positions": positions, "hidden": hidden}
    out.update({f: getattr(meta, f) for f in META_FIELDS})
    return out


def _meta(x: dict) -> AttentionMetadata:
    return AttentionMetadata(**{f: x[f] for f in META_FIELDS})


class Forwards:
    """`graphs`: the engine's CUDA graph owner when whole-forward graphs exist (FULL modes on CUDA)."""

    def __init__(
        self, target_fn, drafter_fn, target_caches, draft_caches, aux_layers, graphs: CudaGraphs | None = None
    ):
        self.target_fn, self.drafter_fn = target_fn, drafter_fn
        self.target_caches, self.draft_caches, self.aux_layers = target_caches, draft_caches, aux_layers
        self.graphs = graphs
        self.hits: Counter = Counter()  # "fn/dispatch key" -> calls

    def target(self, d: Dispatch, ids, positions, meta):
        self.hits[f"target/{d.key}"] += 1
        if d.runtime == "FULL" and self.graphs is not None:
            call = lambda x: self.target_fn(x["ids"], x["positions"], _meta(x), self.target_caches, self.aux_layers)
            return self.graphs.run_whole(d.graph_key("target"), _flat(ids, positions, meta), call)
        return self.target_fn(ids, positions, meta, self.target_caches, self.aux_layers)

    def drafter(self, d: Dispatch, ids, positions, hidden, meta):
        self.hits[f"drafter/{d.key}"] += 1
        if d.runtime == "FULL" and self.graphs is not None:
            call = lambda x: self.drafter_fn(x["ids"], x["positions"], x["hidden"], _meta(x), self.draft_caches)
            return self.graphs.run_whole(d.graph_key("drafter"), _flat(ids, positions, meta, hidden), call)
        return self.drafter_fn(ids, positions, hidden, meta, self.draft_caches)

    def loop(self, key: GraphKey, inputs: dict, loop_fn):
        """The fused draft loop (`loop_fn(**inputs)`) as one graph, or its compiled code without one."""
        self.hits[key.name] += 1
        if self.graphs is not None:
            return self.graphs.run_whole(key, inputs, lambda x: loop_fn(kv_caches=self.draft_caches, **x))
        return loop_fn(kv_caches=self.draft_caches, **inputs)
