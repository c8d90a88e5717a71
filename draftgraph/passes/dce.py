"""Dead-code elimination: drop nodes whose values nothing uses (impure nodes, such as the attention op
that writes the KV cache, are kept by FX's own rule)."""

from __future__ import annotations

from torch import fx

from draftgraph.passes.base import GraphPass


class DeadCodeElimination(GraphPass):
    name = "dce"

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm
