"""CompileCounters: one object per engine counting what the compiler and the graph runtime did."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CompileCounters:
    """Tests assert on these; `engine.stats()` reports them."""

    traces: Counter = field(default_factory=Counter)  # Dynamo traces (backend calls) per compiled function
    pieces: int = 0  # compute pieces produced by splitting (attention pieces not counted)
    unique_pieces: int = 0  # compute pieces after deduplicating identical layers
    inductor_compiles: int = 0  # Inductor compiles (per unique piece, per size, plus dynamic versions)
    # unique pieces whose compiled code an earlier engine of this process compiled (a shared_compile_workers
    # block: pool_lifetime.shared_pieces), and the Inductor compiles that saved
    pieces_reused: int = 0
    compiles_reused: int = 0
    graphs_captured: int = 0
    graphs_released: int = 0  # graphs dropped to be captured again (a KV cache sized by reallocation: memory.py)
    graph_replays: Counter = field(default_factory=Counter)  # key "fn/size" -> replays of its piece graphs
    compiled_runs: Counter = field(default_factory=Counter)  # key "fn/size" -> piece runs without a graph
    dynamic_runs: Counter = field(default_factory=Counter)  # key "fn" -> piece runs past the captured sizes
    compile_seconds: float = 0.0
    warmup_seconds: dict = field(default_factory=dict)  # warm-up phase -> seconds (runtime/warmup.py)
    compile_workers: int = 0  # processes that compiled pieces in parallel (compiler/pool/compile_pool.py)
    compile_worker_failures: int = 0  # pieces a worker could not compile (compiled in-process instead)
    piece_compile_seconds: dict = field(default_factory=dict)  # "fn/submod/key" -> seconds of its compiles
    compile_pool: dict = field(default_factory=dict)  # the workers' timeline (CompilePool.timeline)
    kernels_ahead: dict = field(default_factory=dict)  # our kernels compiled ahead (KernelsAhead.close)
    capture_seconds: float = 0.0
    # compiled variants of draftgraph's own Triton kernels that warm-up and capture added (ops/kernel_variants.py):
    # a number that grows with the capture sizes is a launcher specialising on the batch size
    kernel_variants: dict = field(default_factory=dict)
    kernels_restored: int = 0  # compiled kernels and launchers put into Triton's cache from artifacts
    graph_memory_bytes: int = 0
    static_buffer_bytes: int = 0  # input buffers graphs copy into before replay (activations only)

    def as_dict(self) -> dict:
        return {
            "traces": dict(self.traces),
            "pieces": self.pieces,
            "unique_pieces": self.unique_pieces,
            "inductor_compiles": self.inductor_compiles,
            "pieces_reused": self.pieces_reused,
            "compiles_reused": self.compiles_reused,
            "graphs_captured": self.graphs_captured,
            "graphs_released": self.graphs_released,
            "graph_replays": dict(self.graph_replays),
            "compiled_runs": dict(self.compiled_runs),
            "dynamic_runs": dict(self.dynamic_runs),
            "compile_seconds": round(self.compile_seconds, 2),
            "warmup_seconds": {k: round(v, 2) for k, v in self.warmup_seconds.items()},
            "compile_workers": self.compile_workers,
            "compile_worker_failures": self.compile_worker_failures,
            "piece_compile_seconds": {k: round(v, 2) for k, v in self.piece_compile_seconds.items()},
            "compile_pool": dict(self.compile_pool),
            "kernels_ahead": dict(self.kernels_ahead),
            "capture_seconds": round(self.capture_seconds, 2),
            "kernel_variants": dict(self.kernel_variants),
            "kernels_restored": self.kernels_restored,
            "graph_memory_bytes": self.graph_memory_bytes,
            "static_buffer_bytes": self.static_buffer_bytes,
        }
