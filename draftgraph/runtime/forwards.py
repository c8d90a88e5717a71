"""Run the target forward, the drafter step and the fused draft loop for a `Dispatch`: a FULL graph
replay, or the function itself (compiled with its piece graphs, or eager) at the dispatch's padded size.
Every call counts one hit for the graph that ran, or "none" (`engine.stats()["dispatch"]`); in a graph mode,
a call without a graph is also a fallback, counted by its dispatch key (`engine.stats()["fallbacks_by_key"]`)."""

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
        graph_mode: bool = False,
    ):
        self.target_fn, self.drafter_fn = target_fn, drafter_fn
        self.target_caches, self.draft_caches, self.aux_layers = target_caches, draft_caches, aux_layers
        self.full_target, self.full_drafter = full_target, full_drafter
        self.graph_mode = graph_mode  # the mode asks for CUDA graphs: a call without one is a fallback
        self.hits: Counter = Counter()  # "fn/key of the graph that ran" (or "fn/none") -> calls
        self.fallbacks: Counter = Counter()  # "fn/dispatch key" -> calls without a graph in a graph mode

    def reset(self) -> None:
        self.hits.clear()
        self.fallbacks.clear()

    def _count(self, fn: str, key: str, graph: bool) -> None:
        self.hits[f"{fn}/{key if graph else 'none'}"] += 1
        if not graph and self.graph_mode:
            self.fallbacks[f"{fn}/{key}"] += 1

    def target(self, d: Dispatch, ids, positions, meta):
        if d.runtime == "FULL" and self.full_target is not None:
            call = lambda x: self.target_fn(x["ids"], x["positions"], _meta(x), self.target_caches, self.aux_layers)
            out = self.full_target.run(d.key, _flat(ids, positions, meta), call)
            self._count("target", d.key, self.full_target.graphs.get(d.key) is not None)
            return out
        self._count("target", d.key, d.graph and d.runtime == "PIECEWISE")
        return self.target_fn(ids, positions, meta, self.target_caches, self.aux_layers)

    def drafter(self, d: Dispatch, ids, positions, hidden, meta):
        if d.runtime == "FULL" and self.full_drafter is not None:
            call = lambda x: self.drafter_fn(x["ids"], x["positions"], x["hidden"], _meta(x), self.draft_caches)
            out = self.full_drafter.run(d.key, _flat(ids, positions, meta, hidden), call)
            self._count("drafter", d.key, self.full_drafter.graphs.get(d.key) is not None)
            return out
        self._count("drafter", d.key, d.graph and d.runtime == "PIECEWISE")
        return self.drafter_fn(ids, positions, hidden, meta, self.draft_caches)

    def loop(self, key: str, inputs: dict, loop_fn):
        """The fused draft loop (`loop_fn(**inputs)`) as one FULL graph, or its compiled code without one."""
        if self.full_drafter is not None:
            out = self.full_drafter.run(key, inputs, lambda x: loop_fn(kv_caches=self.draft_caches, **x))
            self._count("drafter", key, self.full_drafter.graphs.get(key) is not None)
            return out
        self._count("drafter", key, False)
        return loop_fn(kv_caches=self.draft_caches, **inputs)
