"""FULL mode: one CUDA graph per (function, query length, padded request count) around a whole forward,
attention included.

Inputs are a flat dict of tensors. Registered static tensors (parameters, KV caches, the metadata
builder's persistent buffers, whose views at offset 0 keep their addresses) are read in place; every
other tensor gets a static buffer refilled before a replay. A replay with a shape other than the
captured one is refused: replaying a graph captured for one padded shape on another corrupts memory.
While a full graph is warmed up and captured, the piece runners run their per-size compiled code (no
nested piece graphs), so the whole forward lands in one graph.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from draftgraph.compiler.piece_runner import GraphContext, _strided_copy


class FullGraph:
    def __init__(self, key: str, call: Callable[[dict], object], inputs: dict, ctx: GraphContext):
        self.key = key
        in_place = ctx.static_ptrs | ctx.persistent_ptrs
        self.static = {k: v is not None and v.data_ptr() in in_place for k, v in inputs.items()}
        self.inputs = {k: v if v is None or self.static[k] else _strided_copy(v) for k, v in inputs.items()}
        self.shapes = {k: None if v is None else tuple(v.shape) for k, v in inputs.items()}
        with pieces_without_graphs(ctx):
            call(self.inputs)  # warm-up outside capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=ctx.graph_pool()):
                self.outputs = call(self.inputs)

    def replay(self, inputs: dict):
        for k, v in inputs.items():
            if v is None:
                continue
            if tuple(v.shape) != self.shapes[k]:
                raise RuntimeError(
                    f"full graph {self.key}: input {k!r} has shape {tuple(v.shape)}, captured with "
                    f"{self.shapes[k]}; a padded shape must replay only its own graph"
                )
            if v.data_ptr() == self.inputs[k].data_ptr():
                continue
            if self.static[k]:  # captured reading a registered buffer in place: never write into it
                raise RuntimeError(
                    f"full graph {self.key}: input {k!r} was captured in place from a persistent "
                    "buffer and now comes from elsewhere; capture with the buffers the step uses"
                )
            self.inputs[k].copy_(v)
        self.graph.replay()
        return self.outputs


@contextlib.contextmanager
def pieces_without_graphs(ctx: GraphContext):
    saved = ctx.graphs_enabled
    ctx.graphs_enabled = False
    try:
        yield
    finally:
        ctx.graphs_enabled = saved


class FullGraphs:
    """The full graphs of one function, by key (see runtime/dispatcher.py for the keys)."""

    def __init__(self, name: str, ctx: GraphContext):
        self.name, self.ctx = name, ctx
        self.graphs: dict[str, FullGraph] = {}

    def run(self, key: str, inputs: dict, call: Callable[[dict], object]):
        graph = self.graphs.get(key)
        if graph is None and self.ctx.allow_capture:
            t0 = time.perf_counter()
            graph = self.graphs[key] = FullGraph(key, call, inputs, self.ctx)
            self.ctx.counters.graphs_captured += 1
            self.ctx.counters.capture_seconds += time.perf_counter() - t0
        if graph is None:  # not captured (outside the capture phase): run the compiled code directly
            self.ctx.counters.compiled_runs[f"{self.name}/{key}"] += 1
            return call(inputs)
        self.ctx.counters.graph_replays[f"{self.name}/{key}"] += 1
        return graph.replay(inputs)
