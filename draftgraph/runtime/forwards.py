"""Run the target forward, the drafter step and the fused draft loop for a `Dispatch`: a whole-forward
CUDA graph (through the engine's `CudaGraphs`), or the function itself (compiled with its piece graphs, or
eager) at the dispatch's padded size. Every call counts one hit for the graph that ran, or "none"
(`engine.stats()["dispatch"]`); in a graph mode, a call without a graph is also a fallback, counted by its
dispatch key (`engine.stats()["fallbacks_by_key"]`)."""

from __future__ import annotations

from collections import Counter

from draftgraph.compiler.cuda_graphs import CudaGraphs, GraphKey
from draftgraph.ops.attention.metadata import META_FIELDS, AttentionMetadata
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
        self,
        target_fn,
        drafter_fn,
        target_caches,
        draft_caches,
        aux_layers,
        graphs: CudaGraphs | None = None,
        graph_mode: bool = False,
    ):
        self.target_fn, self.drafter_fn = target_fn, drafter_fn
        self.target_caches, self.draft_caches, self.aux_layers = target_caches, draft_caches, aux_layers
        self.graphs = graphs
        self.graph_mode = graph_mode  # the mode asks for CUDA graphs: a call without one is a fallback
        self.hits: Counter = Counter()  # "fn/key of the graph that ran" (or "fn/none") -> calls
        self.fallbacks: Counter = Counter()  # "fn/dispatch key" -> calls without a graph in a graph mode

    def reset(self) -> None:
        self.hits.clear()
        self.fallbacks.clear()

    def _count(self, key: GraphKey | None, fn: str, graph: bool) -> None:
        name = key.name if key is not None else f"{fn}/none"
        self.hits[name if graph else f"{fn}/none"] += 1
        if not graph and self.graph_mode:
            self.fallbacks[name] += 1

    def _whole(self, key: GraphKey, inputs: dict, call):
        out = self.graphs.run_whole(key, inputs, call)
        self._count(key, key.fn, key in self.graphs.graphs)
        return out

    def target(self, d: Dispatch, ids, positions, meta):
        key = d.graph_key("target")
        if d.runtime == "FULL" and self.graphs is not None:
            call = lambda x: self.target_fn(x["ids"], x["positions"], _meta(x), self.target_caches, self.aux_layers)
            return self._whole(key, _flat(ids, positions, meta), call)
        self._count(key, "target", d.graph and d.runtime == "PIECEWISE")
        return self.target_fn(ids, positions, meta, self.target_caches, self.aux_layers)

    def drafter(self, d: Dispatch, ids, positions, hidden, meta):
        key = d.graph_key("drafter")
        if d.runtime == "FULL" and self.graphs is not None:
            call = lambda x: self.drafter_fn(x["ids"], x["positions"], x["hidden"], _meta(x), self.draft_caches)
            return self._whole(key, _flat(ids, positions, meta, hidden), call)
        self._count(key, "drafter", d.graph and d.runtime == "PIECEWISE")
        return self.drafter_fn(ids, positions, hidden, meta, self.draft_caches)

    def step(self, key: GraphKey, inputs: dict, step_fn):
        """A uniform batch's whole step (`step_fn(inputs)`) as one graph, or its code without one."""
        if self.graphs is not None:
            return self._whole(key, inputs, step_fn)
        self._count(key, "step", False)
        return step_fn(inputs)

    def loop(self, key: GraphKey, inputs: dict, loop_fn):
        """The fused draft loop (`loop_fn(**inputs)`) as one graph, or its compiled code without one."""
        if self.graphs is not None:
            return self._whole(key, inputs, lambda x: loop_fn(kv_caches=self.draft_caches, **x))
        self._count(key, "drafter", False)
        return loop_fn(kv_caches=self.draft_caches, **inputs)
