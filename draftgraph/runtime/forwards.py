"""Run the target forward, the drafter step and the fused draft loop for a `Dispatch`: a FULL graph
replay, or the function itself (compiled with its piece graphs, or eager) at the dispatch's padded size.
Every call counts one hit for its dispatch key (`engine.stats()["dispatch"]`)."""

from __future__ import annotations

from collections import Counter

from draftgraph.compiler.full_graph import FullGraphs
from draftgraph.models.attention.metadata import META_FIELDS, AttentionMetadata
from draftgraph.runtime.dispatcher import Dispatch


def _flat(ids, positions, meta: AttentionMetadata, hidden=None) -> dict:
    out = {"ids": ids, "positions": positions, "hidden": hidden}
    out.update({f: getattr(meta, f) for f in META_FIELDS})
    return out


def _meta(x: dict) -> AttentionMetadata:
    return AttentionMetadata(**{f: x[f] for f in META_FIELDS})


class Forwards:
    def __init__(
        self,
        target_fn,
        drafter_fn,
        target_caches,
        draft_caches,
        aux_layers,
        full_target: FullGraphs | None = None,
        full_drafter: FullGraphs | None = None,
    ):
        self.target_fn, self.drafter_fn = target_fn, drafter_fn
        self.target_caches, self.draft_caches, self.aux_layers = target_caches, draft_caches, aux_layers
        self.full_target, self.full_drafter = full_target, full_drafter
        self.hits: Counter = Counter()  # "fn/dispatch key" -> calls

    def target(self, d: Dispatch, ids, positions, meta):
        self.hits[f"target/{d.key}"] += 1
        if d.runtime == "FULL" and self.full_target is not None:
            call = lambda x: self.target_fn(x["ids"], x["positions"], _meta(x), self.target_caches, self.aux_layers)
            return self.full_target.run(d.key, _flat(ids, positions, meta), call)
        return self.target_fn(ids, positions, meta, self.target_caches, self.aux_layers)

    def drafter(self, d: Dispatch, ids, positions, hidden, meta):
        self.hits[f"drafter/{d.key}"] += 1
        if d.runtime == "FULL" and self.full_drafter is not None:
            call = lambda x: self.drafter_fn(x["ids"], x["positions"], x["hidden"], _meta(x), self.draft_caches)
            return self.full_drafter.run(d.key, _flat(ids, positions, meta, hidden), call)
        return self.drafter_fn(ids, positions, hidden, meta, self.draft_caches)

    def loop(self, key: str, inputs: dict, loop_fn):
        """The fused draft loop (`loop_fn(**inputs)`) as one FULL graph, or its compiled code without one."""
        self.hits[f"drafter/{key}"] += 1
        if self.full_drafter is not None:
            return self.full_drafter.run(key, inputs, lambda x: loop_fn(kv_caches=self.draft_caches, **x))
        return loop_fn(kv_caches=self.draft_caches, **inputs)
