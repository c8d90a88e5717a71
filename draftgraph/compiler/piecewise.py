"""The piecewise Dynamo backend: passes, split at attention, each compute piece compiled per size.

Dynamo calls the backend once per traced function, with the token dimension unbacked-symbolic. The
backend runs the pass manager (which ends by splitting at the attention op), compiles each unique
compute piece with Inductor for every capture size plus one dynamic-shape version, and swaps each
piece's submodule for a `PieceRunner` (compiler/piece_runner.py) that picks, per call, a CUDA graph, a
per-size compiled piece, or the dynamic one. Attention pieces stay as they are and run eagerly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from tqdm import tqdm

from draftgraph.compiler.piece_runner import GraphContext, PieceRunner
from draftgraph.passes.manager import PassManager
from draftgraph.passes.split_attention import Piece


@dataclass
class CompiledPiece:
    """One unique compute piece's compiled code: per capture size, and for any size."""

    per_size: dict[int, Callable]
    dynamic: Callable
    multi_output: bool


class PiecewiseBackend:
    """A torch.compile backend (`backend=PiecewiseBackend(...)`) for one model function."""

    def __init__(
        self,
        fn_name: str,
        sizes: tuple[int, ...],
        ctx: GraphContext,
        passes: PassManager,
        compile_backend: str = "inductor",
        cache_dir: str | None = None,
    ):
        if compile_backend not in ("inductor", "eager"):
            raise ValueError(f"compile_backend={compile_backend!r} is unknown; choose 'inductor' or 'eager'")
        self.fn_name, self.sizes, self.ctx, self.passes = fn_name, tuple(sorted(sizes)), ctx, passes
        self.compile_backend, self.cache_dir = compile_backend, cache_dir
        self._compiled: dict[str, CompiledPiece] = {}  # structural key -> compiled code (shared by layers)
        self.traces: list = []  # (graph after passes, SplitGraph) per Dynamo trace, for inspection
        # Per trace, what an artifact needs to run it without Dynamo (compiler/artifacts.py): the Python
        # expression of each graph input, and each compute piece's size locator.
        self.records: list[dict] = []
        self.recorded_outputs: dict[int, tuple] | None = None  # trace -> last outputs, while recording

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        counters = self.ctx.counters
        counters.traces[self.fn_name] += 1
        t0 = time.perf_counter()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sources = [_source_name(n) for n in placeholders]
        static_shapes = [_static_shape(n.meta.get("example_value")) for n in placeholders]
        split = self.passes.run(gm, self.fn_name)
        self.traces.append((gm, split))
        token = token_symbol(gm)
        pieces = split.compute_pieces
        todo = [p for p in pieces if p.key not in self._compiled]
        unique_todo = list({p.key: p for p in todo}.values())
        per_piece = len(self.sizes) + 1 if self.compile_backend == "inductor" else 0
        bar = tqdm(
            total=len(unique_todo) * per_piece,
            desc=f"compiling {self.fn_name}",
            unit="graph",
            disable=per_piece == 0 or not self.ctx.progress,
            leave=False,
        )
        with _cache_dir(self.cache_dir):
            for p in unique_todo:
                self._compiled[p.key] = self._compile(p, token, bar)
        bar.close()
        runners = [PieceRunner(self.fn_name, p, self._compiled[p.key], token, self.ctx) for p in pieces]
        for p, r in zip(pieces, runners):
            setattr(split.module, p.name, r)
        self.records.append(
            {
                "sources": sources,
                "static_shapes": static_shapes,
                "split": split,
                "size_at": {p.name: list(r.size_at) for p, r in zip(pieces, runners)},
            }
        )
        counters.pieces += len(pieces)
        counters.unique_pieces += len(unique_todo)
        counters.compile_seconds += time.perf_counter() - t0
        split.module.recompile()
        return _recorded(self, len(self.records) - 1, split.module)

    def _compile(self, piece: Piece, token, bar) -> CompiledPiece:
        gm = piece.graph
        multi = _returns_tuple(gm)
        if self.compile_backend == "eager":
            return CompiledPiece({s: gm for s in self.sizes}, gm, multi)
        from torch._inductor import standalone_compile

        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        per_size = {}
        if _only_depends_on(fakes, token):
            with torch._guards.tracing(None), torch._subclasses.fake_tensor.unset_fake_temporarily():
                for size in self.sizes:
                    per_size[size] = standalone_compile(
                        gm, concrete_inputs(fakes, token, size), dynamic_shapes="from_example_inputs"
                    )
                    self.ctx.counters.inductor_compiles += 1
                    bar.update(1)
        dynamic = standalone_compile(gm, fakes, dynamic_shapes="from_tracing_context")
        self.ctx.counters.inductor_compiles += 1
        bar.update(1)
        return CompiledPiece(per_size, dynamic, multi)


def _recorded(backend: PiecewiseBackend, index: int, module):
    """The split module as Dynamo calls it; keeps its outputs while an artifact build records them. (A
    plain function: tools that read compiled code, depyf among them, expect one.)"""

    def run(*args):
        out = module(*args)
        if backend.recorded_outputs is not None:
            backend.recorded_outputs[index] = out
        return out

    return run


def _static_shape(value):
    if not isinstance(value, torch.Tensor):
        return None
    return [None if isinstance(d, torch.SymInt) else int(d) for d in value.shape]


def _source_name(node) -> str | None:
    """The Python expression (over the frame's locals `L`) Dynamo reads this graph input from."""
    arg = node.meta.get("grapharg")
    if arg is None or arg.source is None:
        return None
    name = arg.source.name
    return name() if callable(name) else name


def token_symbol(gm: fx.GraphModule):
    """The symbol of the token dimension: dim 0 of `input_ids` (else the first symbolic dim 0)."""
    candidates = []
    for node in gm.graph.nodes:
        ev = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(ev, torch.Tensor) and ev.dim() and isinstance(ev.shape[0], torch.SymInt):
            candidates.append((0 if "input_ids" in node.name else 1, ev.shape[0].node.expr))
    if not candidates:
        raise ValueError("the traced graph has no symbolic token dimension; were the batch dims marked?")
    return min(candidates, key=lambda c: c[0])[1]


def _free(value) -> set:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        out = set()
        for d in value.shape:
            if isinstance(d, torch.SymInt):
                out |= d.node.expr.free_symbols
        return out
    return set()


def _only_depends_on(fakes, token) -> bool:
    return all(_free(v) <= {token} for v in fakes)


def concrete_inputs(fakes, token, size: int) -> list:
    """Real example inputs for one size: every symbolic size and stride with the token symbol set to
    `size` (strides matter: Inductor's per-size code asserts them, and views like cos/sin are strided)."""
    sub = {token: sympy.Integer(size)}

    def val(d):
        return int(d.node.expr.xreplace(sub)) if isinstance(d, torch.SymInt) else int(d)

    out = []
    for v in fakes:
        if isinstance(v, torch.SymInt):
            out.append(val(v))
        elif isinstance(v, torch.Tensor):
            t = torch.empty_strided(
                [val(d) for d in v.shape], [val(s) for s in v.stride()], dtype=v.dtype, device=v.device
            )
            out.append(t.normal_() if v.dtype.is_floating_point else t.zero_())
        else:
            out.append(v)
    return out


def _returns_tuple(gm: fx.GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


@contextmanager
def _cache_dir(path: str | None):
    """Inductor reads its cache location from the environment at compile time: scope it to the compile."""
    if not path:
        yield
        return
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
