"""PieceRunner: runs one compute piece per call as a CUDA graph, per-size compiled code, or dynamic code.

CUDA graphs (one per piece and size) are captured only while the engine's capture phase allows it,
which walks the sizes largest first, so every graph lands in one shared pool (GraphContext.pool).
Inputs that are parameters, buffers or KV caches are used in place (their addresses never change);
every other tensor input gets a static buffer that is refilled before a replay when the caller's tensor
lives elsewhere. A piece's outputs are the graph's own pool tensors, overwritten by its next replay:
callers consume them before running that piece at that size again (the engine does, step by step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from draftgraph.compiler.counters import CompileCounters

log = logging.getLogger("draftgraph")


@dataclass
class GraphContext:
    """What the piece runners of one engine share."""

    counters: CompileCounters
    graphs_enabled: bool  # CUDA graphs on (a CUDA device and a graph mode)
    capture_sizes: tuple[int, ...]
    check_addresses: bool = False  # debug: verify static input addresses at every replay
    progress: bool = True
    allow_capture: bool = False  # set by the engine's capture phase only
    pool: object = None
    static_ptrs: set = field(default_factory=set)  # parameters, buffers, KV caches: used in place
    # The metadata builders' persistent buffers: FULL graphs read their views in place (and refuse a replay
    # whose input moved). Piece graphs must not: a piece also runs on fresh on-device metadata (later draft
    # steps) that its capture would then never see.
    persistent_ptrs: set = field(default_factory=set)

    def register_static(self, tensors) -> None:
        """Tensors whose storage never moves while graphs live: every graph reads them in place."""
        self.static_ptrs.update(t.data_ptr() for t in tensors)

    def register_persistent(self, tensors) -> None:
        self.persistent_ptrs.update(t.data_ptr() for t in tensors)

    def graph_pool(self):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool


class CapturedGraph:
    """One CUDA graph of one piece at one size."""

    def __init__(self, fn, args: list, static: list[bool], pool):
        self.static = static
        self.inputs = [a if s or not isinstance(a, torch.Tensor) else _strided_copy(a) for a, s in zip(args, static)]
        self.addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
        fn(*self.inputs)  # warm-up outside capture: autotuning and lazy initialisation happen here
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            out = fn(*self.inputs)
        self.outputs = list(out) if isinstance(out, (list, tuple)) else [out]

    def replay(self, args, check: bool, where: str) -> list:
        for i, (a, s) in enumerate(zip(args, self.static)):
            if not isinstance(a, torch.Tensor):
                continue
            if s:
                if check and a.data_ptr() != self.addresses[i]:
                    raise RuntimeError(
                        f"{where}: static input {i} moved from {self.addresses[i]:#x} to {a.data_ptr():#x} "
                        "since capture; a parameter, buffer or KV cache was reallocated after graphs were captured"
                    )
            elif a.data_ptr() != self.inputs[i].data_ptr():
                self.inputs[i].copy_(a)
        self.graph.replay()
        return self.outputs


class PieceRunner(nn.Module):
    """Stands in for one compute submodule of the split graph."""

    def __init__(self, fn_name: str, piece, compiled, token, ctx: GraphContext, size_at=None):
        super().__init__()
        self.fn_name, self.piece, self.compiled, self.ctx = fn_name, piece, compiled, ctx
        self.graphs: dict[int, CapturedGraph] = {}
        if size_at is None:  # from the traced piece's example values (a loaded artifact passes it)
            phs = [n for n in piece.graph.graph.nodes if n.op == "placeholder"]
            size_at = _size_locator(phs, token)
        self.size_at = tuple(size_at)

    def forward(self, *args):
        size = self._size(args)
        key = f"{self.fn_name}/{size}"
        ctx = self.ctx
        # Inside a FULL graph's capture (graphs_enabled off) a piece runs its code, never its own graph
        # (with lazy capture, a piece graph of that size may already exist).
        graph = self.graphs.get(size) if ctx.graphs_enabled else None
        if graph is None and ctx.graphs_enabled and ctx.allow_capture and size in self.compiled.per_size:
            graph = self._capture(size, args)
        if graph is not None:
            ctx.counters.graph_replays[key] += 1
            out = graph.replay(args, ctx.check_addresses, f"{key} piece {self.piece.index}")
        elif size in self.compiled.per_size:
            ctx.counters.compiled_runs[key] += 1
            out = self.compiled.per_size[size](*args)
        else:
            ctx.counters.dynamic_runs[self.fn_name] += 1
            out = self.compiled.dynamic(*args)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return tuple(out) if self.compiled.multi_output else out[0]

    def _size(self, args) -> int | None:
        kind, i = self.size_at
        if kind == "int":
            return int(args[i])
        if kind == "shape":
            return int(args[i].shape[0])
        return None

    def _capture(self, size: int, args) -> CapturedGraph:
        # Static by identity, not by name: a parameter, buffer or KV cache the engine registered.
        static = [isinstance(a, torch.Tensor) and a.data_ptr() in self.ctx.static_ptrs for a in args]
        stray = [i for i, (a, st) in enumerate(zip(args, static)) if isinstance(a, nn.Parameter) and not st]
        if stray:  # a parameter copied before every replay would be slow and double its memory
            raise RuntimeError(
                f"{self.fn_name} piece {self.piece.index}: inputs {stray} are parameters the engine did not "
                "register as static (GraphContext.register_static); refusing to capture copies of weights"
            )
        t0 = time.perf_counter()
        graph = CapturedGraph(self.compiled.per_size[size], list(args), static, self.ctx.graph_pool())
        self.ctx.counters.capture_seconds += time.perf_counter() - t0
        self.ctx.counters.static_buffer_bytes += sum(
            a.numel() * a.element_size() for a, s in zip(args, static) if isinstance(a, torch.Tensor) and not s
        )
        self.graphs[size] = graph
        self.ctx.counters.graphs_captured += 1
        # The capture itself ran nothing: replay once so this call returns real values.
        return graph


def _size_locator(placeholders, token) -> tuple[str, int]:
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


def _strided_copy(a: torch.Tensor) -> torch.Tensor:
    """A static buffer with a's exact strides (compiled code asserts them; clone() would compact views)."""
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
