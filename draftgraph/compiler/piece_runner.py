"""PieceRunner: stands in for one compute piece of a split graph and runs it per call as a CUDA graph
(through the engine's `CudaGraphs`), or as its compiled code.

A piece is compiled once with the token count symbolic (compiler/piecewise.py); its CUDA graph at each
capture size is captured from that same code (or from a per-size compile where the user listed the size in
`compile_sizes`). Sizes past the capture sizes run the symbolic code without a graph.
"""

from __future__ import annotations

import torch
from torch import nn

from draftgraph.compiler.cuda_graphs import CudaGraphs, GraphKey


class PieceRunner(nn.Module):
    def __init__(self, fn_name: str, piece, compiled, token, ctx: CudaGraphs, size_at=None):
        super().__init__()
        self.fn_name, self.piece, self.compiled, self.ctx = fn_name, piece, compiled, ctx
        if size_at is None:  # from the traced piece's example values (a loaded artifact passes it)
            phs = [n for n in piece.graph.graph.nodes if n.op == "placeholder"]
            size_at = size_locator(phs, token)
        self.size_at = tuple(size_at)
        self.graph_id = ctx.new_piece_id()  # unique in the engine: a function may have several traces
        self._keys: dict[int, tuple[GraphKey, str]] = {}  # size -> (this piece's graph key, stats name)

    def forward(self, *args):
        ctx, compiled = self.ctx, self.compiled
        if compiled.host_only:  # size checks only: no kernel to graph or count
            return compiled.dynamic(*args)
        size = self._size(args)
        if size is None or size not in ctx.capture_sizes:
            ctx.counters.dynamic_runs[self.fn_name] += 1
            out = compiled.dynamic(*args)
        elif ctx.piece_graphs_now():
            out = ctx.run_piece(self._key(size)[0], compiled.for_size(size), list(args))
        else:
            ctx.counters.compiled_runs[self._key(size)[1]] += 1
            out = compiled.for_size(size)(*args)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return tuple(out) if compiled.multi_output else out[0]

    def _key(self, size: int) -> tuple[GraphKey, str]:
        """Built once per size: this runs for every piece of every step."""
        if size not in self._keys:
            key = GraphKey.piecewise(self.fn_name, size, self.graph_id)
            self._keys[size] = (key, key.name)
        return self._keys[size]

    def _size(self, args) -> int | None:
        kind, i = self.size_at
        if kind == "int":
            return int(args[i])
        if kind == "shape":
            return int(args[i].shape[0])
        return None


def size_locator(placeholders, token) -> tuple[str, int]:
    """Where a call's token count is read from: ("int", i) / ("shape", i), or ("none", -1) when the piece's
    shapes follow another batch size too (the request count, unbacked like the token count): such a piece runs
    its code, never a graph keyed by the token count alone. Backed symbols are sizes an engine keeps from step to
    step, such as the KV cache's block count (marked dynamic so a resized cache re-uses the trace): a piece that
    writes the caches (the RoPE kernel's KV write) is graphed by its token count like the rest, its graph taking
    the caches' addresses as a FULL graph does."""
    free = set()
    for n in placeholders:
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.SymInt):
            free |= ev.node.expr.free_symbols
        elif isinstance(ev, torch.Tensor):
            for d in (*ev.shape, *ev.stride()):
                if isinstance(d, torch.SymInt):
                    free |= d.node.expr.free_symbols
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # (sympy: not for mode NONE)

    if token is None or free_unbacked_symbols(tuple(free - {token})):
        return ("none", -1)
    for i, n in enumerate(placeholders):
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.SymInt) and ev.node.expr == token:
            return ("int", i)
    for i, n in enumerate(placeholders):
        ev = n.meta.get("example_value")
        symbolic = isinstance(ev, torch.Tensor) and ev.dim() and isinstance(ev.shape[0], torch.SymInt)
        if symbolic and ev.shape[0].node.expr == token:
            return ("shape", i)
    return ("none", -1)
