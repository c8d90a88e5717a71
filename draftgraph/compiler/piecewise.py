"""The piecewise Dynamo backend: passes, split at attention, one Inductor compile per unique piece.

Dynamo calls the backend once per traced function, with the token dimension unbacked-symbolic. The
backend runs the pass manager (which ends by splitting at the attention op) and compiles each unique
compute piece once with Inductor, the token count left symbolic; CUDA graphs for every capture size are
captured from that one compiled code (compiler/piece_runner.py). Pieces are unique across every function
of an engine (`PieceCache`): a draft model truncated from its target, or the fused draft loop, reuses the
target's or the drafter's compiled layers. Within a `shared_compile_workers` block, pieces are also unique
across the engines built in it (`PieceCache.earlier`, compiler/pool/pool_lifetime.py): a later engine runs the code
an earlier one compiled. Per-size compiles happen only for the sizes a user lists
(`CompileConfig.compile_sizes`). Attention pieces stay as they are and run eagerly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import fx
from tqdm import tqdm

from draftgraph.compiler.cuda_graphs import CudaGraphs
from draftgraph.compiler.inductor_options import inductor_patch
from draftgraph.compiler.piece_runner import PieceRunner, size_locator
from draftgraph.compiler.pool.compile_pool import CompilePool
from draftgraph.compiler.pool.kernels_ahead import KernelsAhead
from draftgraph.passes.manager import PassManager
from draftgraph.passes.split_attention import Piece, token_symbol

log = logging.getLogger("draftgraph")


@dataclass
class CompiledPiece:
    """One unique compute piece's compiled code: for any token count, and per listed compile size."""

    per_size: dict[int, Callable]
    dynamic: Callable
    multi_output: bool
    host_only: bool = False  # computes no tensor (the input checks Dynamo adds): no kernel, never a graph

    def for_size(self, size: int) -> Callable:
        return self.per_size.get(size, self.dynamic)


@dataclass
class PieceCache:
    """Compiled pieces by structural key, shared by every function (backend) of one engine; and, where
    `earlier` is given (pool_lifetime.shared_pieces), with the engines built before it in one process."""

    compiled: dict[str, CompiledPiece] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # key -> the function that compiled it
    # pieces earlier engines compiled, by cross-engine key (`engine_key`): read here, added to by `publish`
    earlier: dict | None = None
    cross_keys: dict[str, str] = field(default_factory=dict)  # structural key -> cross-engine key

    def take_earlier(self, piece: Piece) -> CompiledPiece | None:
        """An earlier engine's compiled code for `piece`, now this engine's too; None when there is none (or no
        earlier engines to look at: the cross-engine key is then not computed)."""
        if self.earlier is None:
            return None
        cross_key = self.cross_keys[piece.key] = engine_key(piece)
        found = self.earlier.get(cross_key)
        if found is not None:
            self.compiled[piece.key] = found
        return found

    def publish(self) -> None:
        """Offer this engine's compiled pieces to the engines built after it (their compiles are loaded)."""
        if self.earlier is None:
            return
        for key, cp in self.compiled.items():
            if key in self.cross_keys:
                self.earlier.setdefault(self.cross_keys[key], cp)


def engine_key(piece: Piece) -> str:
    """What compiled code depends on beyond a piece's structural key: the value ranges of its symbols
    (Inductor picks 32-bit indexing, and drops checks, from what a size can be), in order of first appearance.
    Equal in another engine's trace, the same compiled code serves both."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    env = ctx.fake_mode.shape_env if ctx is not None and ctx.fake_mode is not None else None
    seen: list = []
    for node in piece.graph.graph.nodes:
        if node.op != "placeholder":
            continue
        ev = node.meta.get("example_value")
        dims = [ev] if isinstance(ev, torch.SymInt) else []
        if isinstance(ev, torch.Tensor):
            dims = list(ev.shape) + (list(ev.stride()) if ev.layout == torch.strided else [])
        for d in dims:
            if isinstance(d, torch.SymInt):
                seen += [s for s in sorted(d.node.expr.free_symbols, key=str) if s not in seen]
    ranges = [str(env.var_to_range.get(s)) if env is not None else "?" for s in seen]
    return piece.key + "|" + ";".join(ranges) + "|" + _constants_hash(piece.graph)


def _constants_hash(gm: fx.GraphModule) -> str:
    """The values of the tensors a piece reads as constants (get_attr): the structural key names them only,
    and compiled code bakes them in; two models' pieces alike but for such a value must not share code."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)  # 1-D: viewable as bytes at any rank
            h.update(f"{node.target}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{node.target}:{value!r}".encode())
    return h.hexdigest()[:16]


class PiecewiseBackend:
    """A torch.compile backend (`backend=PiecewiseBackend(...)`) for one model function."""

    def __init__(
        self,
        fn_name: str,
        ctx: CudaGraphs,
        passes: PassManager,
        compile_backend: str = "inductor",
        cache_dir: str | None = None,
        compile_sizes: tuple[int, ...] = (),
        shared: PieceCache | None = None,
        inductor_options: tuple[tuple[str, object], ...] = (),
        pool: CompilePool | None = None,
        ahead: KernelsAhead | None = None,
    ):
        if compile_backend not in ("inductor", "eager"):
            raise ValueError(f"compile_backend={compile_backend!r} is unknown; choose 'inductor' or 'eager'")
        self.fn_name, self.ctx, self.passes = fn_name, ctx, passes
        self.compile_sizes = tuple(sorted(compile_sizes))  # per-size Inductor compiles (opt-in)
        self.compile_backend, self.cache_dir = compile_backend, cache_dir
        self.shared = shared if shared is not None else PieceCache()
        self.inductor_options = inductor_options
        self.pool = pool  # compile workers (compiler/pool/compile_pool.py); None: every compile in this process
        self.ahead = ahead  # compiles our ops' kernels ahead (compiler/pool/kernels_ahead.py); None: at first launch
        self._compiled: dict[str, CompiledPiece] = {}  # structural key -> compiled code this function uses
        self.traces: list = []  # (graph after passes, SplitGraph) per Dynamo trace, for inspection
        # Per trace, what an artifact needs to run it without Dynamo (artifacts/store.py): the Python
        # expression of each graph input, and each compute piece's size locator.
        self.records: list[dict] = []
        self.recorded_outputs: dict[int, tuple] | None = None  # trace -> last outputs, while recording

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        counters = self.ctx.counters
        counters.traces[self.fn_name] += 1
        t0 = time.perf_counter()
        # our kernels compile in threads while this function's pieces compile
        queued = self.ahead.submit_graph(gm) if self.ahead is not None else None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sources = [_source_name(n) for n in placeholders]
        static_shapes = [_static_shape(n.meta.get("example_value")) for n in placeholders]
        split = self.passes.run(gm, self.fn_name)
        self.traces.append((gm, split))
        token = token_symbol(gm)
        pieces = split.compute_pieces
        new = list({p.key: p for p in pieces if p.key not in self.shared.compiled}.values())
        todo, taken = [], []  # to compile here; compiled by an earlier engine
        for p in new:
            (todo if self.shared.take_earlier(p) is None else taken).append(p)
        per_piece = len(self.compile_sizes) + 1 if self.compile_backend == "inductor" else 0
        bar = tqdm(
            total=len(todo) * per_piece,
            desc=f"compiling {self.fn_name} ({len(todo)} unique pieces, token count symbolic)",
            unit="compile",
            disable=per_piece == 0 or not self.ctx.progress,
            leave=False,
        )
        with _cache_dir(self.cache_dir):
            for p in todo:
                t1 = time.perf_counter()
                self.shared.compiled[p.key] = self._compile(p, token, bar, f"{self.fn_name}/{p.name}/{p.key[:8]}")
                self.shared.owner[p.key] = self.fn_name
                counters.piece_compile_seconds[f"{self.fn_name}/{p.name}/{p.key[:8]}"] = time.perf_counter() - t1
        bar.close()
        for p in pieces:
            self._compiled[p.key] = self.shared.compiled[p.key]
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
        counters.unique_pieces += len(new)
        counters.pieces_reused += len(taken)
        counters.compiles_reused += sum(self._compiles_of(self.shared.compiled[p.key]) for p in taken)
        counters.compile_seconds += time.perf_counter() - t0
        split.module.recompile()
        if queued is not None:  # our kernels' compiles are queued before the traced code first launches them
            queued.wait(timeout=60.0)
        return _recorded(self, len(self.records) - 1, split.module)

    def _compiles_of(self, cp: CompiledPiece) -> int:
        """The Inductor compiles a piece's code took (what reusing it saves)."""
        return 0 if self.compile_backend == "eager" or cp.host_only else len(cp.per_size) + 1

    def _compile(self, piece: Piece, token, bar, name: str) -> CompiledPiece:
        gm = piece.graph
        multi = _returns_tuple(gm)
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        graphable = size_locator([n for n in gm.graph.nodes if n.op == "placeholder"], token)[0] != "none"
        host_only = no_tensor_work(gm)
        if self.compile_backend == "eager" or host_only:  # plain FX: nothing for Inductor to do
            bar.update(len(self.compile_sizes) + 1 if self.compile_backend == "inductor" else 0)
            return CompiledPiece({}, gm, multi, host_only)
        from torch._inductor import standalone_compile

        per_size = {}
        if graphable:
            with (
                torch._guards.tracing(None),
                torch._subclasses.fake_tensor.unset_fake_temporarily(),
                inductor_patch(self.inductor_options),
            ):
                for size in self.compile_sizes:
                    per_size[size] = standalone_compile(
                        gm, concrete_inputs(fakes, token, size), dynamic_shapes="from_example_inputs"
                    )
                    self.ctx.counters.inductor_compiles += 1
                    bar.update(1)
        dynamic = self._submit(gm, fakes, name) if self.pool is not None else None
        if dynamic is None:
            with inductor_patch(self.inductor_options):
                dynamic = standalone_compile(gm, fakes, dynamic_shapes="from_tracing_context")
        self.ctx.counters.inductor_compiles += 1
        bar.update(1)
        return CompiledPiece(per_size, dynamic, multi)

    def _submit(self, gm: fx.GraphModule, fakes: list, name: str):
        """The symbolic-size compile of one piece, queued on the compile pool (None: it cannot travel)."""
        from draftgraph.compiler.fx_serialize import encode_module
        from draftgraph.compiler.piece_inputs import NotPortable, encode_inputs

        try:
            graph, inputs = encode_module(gm), encode_inputs(fakes)
        except (TypeError, NotPortable) as e:
            log.info("piece %s compiles in this process: %s", name, e)
            return None
        mode, options = torch._guards.TracingContext.get().fake_mode, self.inductor_options

        def in_process():
            from torch._inductor import standalone_compile

            with torch._guards.tracing(torch._guards.TracingContext(mode)), inductor_patch(options):
                return standalone_compile(gm, fakes, dynamic_shapes="from_tracing_context")

        return self.pool.submit(name, gm, graph, inputs, options, in_process)


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


def concrete_inputs(fakes, token, size: int) -> list:
    """Real example inputs for one size: every symbolic size and stride with the token symbol set to
    `size` (strides matter: Inductor's per-size code asserts them, and views like cos/sin are strided), and
    any backed symbol (the KV cache's block count) at the value it was traced with."""
    import sympy  # here: sympy costs a quarter second to import, and an engine of mode NONE never needs it

    sub = {token: sympy.Integer(size)}

    def val(d):
        if not isinstance(d, torch.SymInt):
            return int(d)
        env = d.node.shape_env  # torch 2.13 renamed var_to_val (2.11's)
        return int(d.node.expr.xreplace(sub).xreplace(getattr(env, "backed_var_to_val", None) or env.var_to_val))

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


def no_tensor_work(gm: fx.GraphModule) -> bool:
    """A piece that computes no tensor (only the size checks Dynamo puts at a function's inputs)."""
    return not any(
        n.op in ("call_function", "call_method", "call_module")
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        for n in gm.graph.nodes
    )


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
