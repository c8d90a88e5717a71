"""Drop Dynamo's runtime asserts that an unbacked size is non-negative.

Marking the batch dims unbacked makes Dynamo insert `_assert_scalar(u >= 0)` for every such size. They
can never fail (a tensor size is never negative), but each one ties the piece it lands in to its
symbol: the assert on the request count lands in the first compute piece, which then depends on two
symbols and cannot be compiled per token count. Legal: removing a check that is true by construction
changes no value. The `Eq(u_i, u0)` asserts (all token-dim inputs agree in size) stay.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from draftgraph.passes.base import GraphPass


def _is_nonneg_check(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not operator.ge or len(node.args) != 2:
        return False
    value, bound = node.args
    if bound != 0 or not isinstance(value, fx.Node):
        return False
    return isinstance(value.meta.get("example_value"), torch.SymInt)


class DropSizeAsserts(GraphPass):
    name = "drop_size_asserts"

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default:
                cond = node.args[0]
                if isinstance(cond, fx.Node) and _is_nonneg_check(cond):
                    gm.graph.erase_node(node)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm
