"""Build an engine's compiled functions: one torch.compile per model function (target forward, drafter
step, fused draft loop variants), all through the piecewise backend, sharing one `PieceCache` (a piece is
compiled once for every function that holds it) and one `CudaGraphs` (the graph owner).

Compiling happens at the first call of each function (the runtime's warm-up, runtime/warmup.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from draftgraph.compiler.compiled_forward import CompiledDrafter, CompiledLoop, CompiledTarget
from draftgraph.compiler.config import FULL_MODES, PIECEWISE_MODES, CompileConfig, ResolvedConfig
from draftgraph.compiler.counters import CompileCounters
from draftgraph.compiler.cuda_graphs import CudaGraphs
from draftgraph.compiler.piecewise import PieceCache, PiecewiseBackend
from draftgraph.compiler.pool.compile_pool import CompilePool
from draftgraph.compiler.pool.kernels_ahead import KernelsAhead, async_compile_mode
from draftgraph.compiler.pool.pool_lifetime import release, shared_pieces
from draftgraph.passes.manager import PassManager

LOOP_VARIANTS = ("greedy", "sample")


@dataclass(frozen=True)
class CompileSettings:
    """How build_compiled works, beside the resolved config: CompileConfig's fields of the same names, none
    of which changes what a graph computes (an artifact records each function's backend itself)."""

    compile_backend: str = "inductor"  # "inductor", or "eager" (split pieces run as plain FX, for debugging)
    cache_dir: str = ""  # Inductor's cache directory; "" = Inductor's default
    check_addresses: bool = False  # debug: verify static input addresses at every graph replay
    dump_graphs_dir: str = ""  # write each pass's before/after graph here ("" = none)
    progress: bool = True  # progress bars for compile and capture

    @classmethod
    def of(cls, config: CompileConfig) -> CompileSettings:
        return cls(config.compile_backend, config.cache_dir, config.check_addresses, config.dump_graphs_dir,
                   config.progress)  # fmt: skip


@dataclass
class CompiledModels:
    counters: CompileCounters
    ctx: CudaGraphs  # the one owner of this engine's CUDA graphs
    target: CompiledTarget
    drafter: CompiledDrafter | None
    pieces: PieceCache
    loop_backend: PiecewiseBackend | None = None  # the fused draft loop's backend (FULL modes with a drafter)
    loops: tuple | None = None  # the fused loop's CompiledLoops, one per LOOP_VARIANTS entry
    full: bool = False  # whole-forward graphs (a FULL mode on CUDA)
    pool: CompilePool | None = None  # compile workers, until the compile phase ends (finish_compiles)
    ahead: KernelsAhead | None = None  # our kernels compiled ahead in threads (CUDA), until finish_compiles

    def finish_compiles(self) -> None:
        """End of the compile phase: wait for the pool's compiles, load them, stop its workers. From here on
        every piece runs its compiled code (before, a piece still compiling ran its FX graph in warm-up)."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            self.counters.kernels_ahead = ahead.close()
        if self.pool is None:  # no pool, so no shared one: nothing to publish
            return
        pool, self.pool = self.pool, None
        try:
            pool.wait_all()
            for p in pool.pending:
                self.counters.piece_compile_seconds[p.name] = p.seconds
            self.counters.compile_worker_failures += pool.failures
            self.counters.compile_pool = pool.timeline()
            self.pieces.publish()  # loaded: the next build in a shared_workers block runs them as they are
        finally:
            release(pool)  # a shared pool (pool_lifetime.shared_workers) stays for the next build

    @property
    def whole_graphs(self) -> CudaGraphs | None:
        """The graph owner when whole-forward graphs exist; None when forwards run their code."""
        return self.ctx if self.full else None


def build_compiled(
    target,
    drafter,
    rc: ResolvedConfig,
    loop_fns: tuple[Callable, ...] | None,
    settings: CompileSettings = CompileSettings(),
    pool: CompilePool | None = None,
) -> CompiledModels:
    """`loop_fns`: the fused draft loop's functions (one per LOOP_VARIANTS entry) when rc fuses the loop."""
    compile_backend, cache_dir = settings.compile_backend, settings.cache_dir
    counters = CompileCounters()
    piece_graphs = rc.graphs_enabled and rc.mode in PIECEWISE_MODES
    ctx = CudaGraphs(
        counters, rc.graphs_enabled, piece_graphs, rc.capture_sizes, settings.check_addresses, settings.progress
    )
    passes = PassManager(dump_dir=settings.dump_graphs_dir or None)
    # compiled code depends on the graph (the piece key) and on these; a shared pool keeps pieces per scope
    scope = (compile_backend, rc.inductor_options, rc.compile_sizes, str(rc.device))
    shared = PieceCache(earlier=shared_pieces(pool, scope))
    ahead = kernels_ahead(rc)

    def backend(name):
        return PiecewiseBackend(
            name, ctx, passes, compile_backend, cache_dir or None, rc.compile_sizes, shared, rc.inductor_options,
            pool, ahead,
        )  # fmt: skip

    ct = CompiledTarget(target, backend("target"))
    cd = CompiledDrafter(drafter, backend("drafter")) if drafter is not None else None
    backend_l, loops = None, None
    if rc.fuse_draft_loop:  # traced once per engine build, whatever cache the runner allocates
        if not loop_fns or len(loop_fns) != len(LOOP_VARIANTS):
            raise ValueError(f"a fused draft loop needs one function per variant {LOOP_VARIANTS}")
        backend_l = backend("draft_loop")
        loops = tuple(CompiledLoop(fn, f"draft_loop_{v}", backend_l) for fn, v in zip(loop_fns, LOOP_VARIANTS))
    full = rc.graphs_enabled and rc.mode in FULL_MODES
    counters.compile_workers = pool.n if pool is not None else 0
    return CompiledModels(counters, ctx, ct, cd, shared, backend_l, loops, full, pool, ahead)


def kernels_ahead(rc: ResolvedConfig) -> KernelsAhead | None:
    """Our Triton kernels compiled ahead in threads (compiler/pool/kernels_ahead.py): on CUDA with Triton's
    AsyncCompileMode."""
    if rc.device.type != "cuda":
        return None
    if async_compile_mode() is None:
        return None
    return KernelsAhead(str(rc.device), max(2, min(8, os.cpu_count() or 2)))
