"""The one owner of an engine's CUDA graphs: keys, the shared pool, capture, replay, counts, memory.

Every graph of an engine goes through one `CudaGraphs`: the piece graphs of PIECEWISE mode (one per piece
and padded token count), the whole-forward graphs of FULL modes (one per function, query length and padded
request count), the fused draft loop's (one per variant and padded request count) and the whole step's
of uniform batches (one per variant and padded request count). Keys are `GraphKey`s,
built only by its constructors. All graphs share one memory pool; eager capture walks the sizes largest
first so smaller graphs reuse the larger ones' memory, lazy capture lets the first step at a size capture.

Inputs that are parameters, buffers or KV caches (`register_static`) and, for whole-forward graphs, the
metadata builders' persistent buffers (`register_persistent`) are read in place; every other tensor input
gets a static buffer that is refilled before a replay when the caller's tensor lives elsewhere. Outputs are
the graph's pool tensors, overwritten by its next replay.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftgraph.compiler.counters import CompileCounters


@dataclass(frozen=True)
class GraphKey:
    """What one graph was captured for. Build with `full`, `loop` or `piecewise`."""

    fn: str  # "target", "drafter", or "step" (a uniform batch's whole speculative step)
    query_len: int | None  # FULL: every request's query length; None: PIECEWISE (keyed by token count)
    size: int  # FULL: padded request count; PIECEWISE: padded token count
    variant: str = ""  # the fused draft loop and the whole step: "greedy" or "sample"
    piece: int | None = None  # a piece graph: its runner's id, unique in the engine (PieceRunner.graph_id)

    @classmethod
    def full(cls, fn: str, query_len: int, num_reqs: int) -> GraphKey:
        return cls(fn, query_len, num_reqs)

    @classmethod
    def loop(cls, query_len: int, num_reqs: int, variant: str) -> GraphKey:
        return cls("drafter", query_len, num_reqs, variant)

    @classmethod
    def step(cls, query_len: int, num_reqs: int, variant: str) -> GraphKey:
        """The whole speculative step of a uniform batch (runtime/uniform_step.py)."""
        return cls("step", query_len, num_reqs, variant)

    @classmethod
    def piecewise(cls, fn: str, num_tokens: int, piece: int | None = None) -> GraphKey:
        return cls(fn, None, num_tokens, "", piece)

    @property
    def dispatch(self) -> str:
        """The key's name without the function: "full/q4/b8", "loop/q4/b8/greedy", "piecewise/t16", and for
        the whole step "q5/b8/greedy"."""
        if self.query_len is None:
            return f"piecewise/t{self.size}"
        if self.fn == "step":
            return f"q{self.query_len}/b{self.size}/{self.variant}"
        if self.variant:
            return f"loop/q{self.query_len}/b{self.size}/{self.variant}"
        return f"full/q{self.query_len}/b{self.size}"

    @functools.cached_property  # read on every replay for the counters: built once
    def name(self) -> str:
        """What stats report hits and replays under: "target/full/q4/b8", "drafter/loop/...", "target/piecewise/t16",
        "step/q5/b8/greedy"."""
        return f"{self.fn}/{self.dispatch}"

    def __str__(self) -> str:
        return self.name if self.piece is None else f"{self.name}/piece{self.piece}"


@dataclass(frozen=True)
class StepShapes:
    """The query lengths of a speculative step's uniform forwards: the `query_len` of its FULL graph keys.
    Derived here only."""

    k: int  # drafts per step (0: plain decoding)
    drafter_reads_hidden: bool = True  # EAGLE / EAGLE-3 / MTP; False: an independent draft model

    @property
    def verify(self) -> int:
        """Target rows per request in a decode step: the last token and K drafts."""
        return self.k + 1

    @property
    def first_draft(self) -> int:
        """Drafter rows per request at its first step: the verify rows (a hidden-state drafter), or one more
        (a draft model also reads the token the target chose)."""
        return self.k + 1 if self.drafter_reads_hidden else self.k + 2

    @property
    def later_draft(self) -> int:
        """Each later draft step (and plain decode): one row per request."""
        return 1

    @property
    def full_query_lens(self) -> tuple[int, ...]:
        lens = {self.verify, self.later_draft}
        if self.k:
            lens.add(self.first_draft)
        return tuple(sorted(lens))


class CapturedGraph:
    """One CUDA graph over a flat list of inputs, captured on `stream` (a side stream, as capture requires)."""

    def __init__(
        self,
        key: GraphKey,
        fn: Callable[[list], object],
        args: list,
        in_place: list[bool],
        pool,
        static: list[bool],
        stream: torch.cuda.Stream,
    ):
        self.key, self.in_place, self.static = key, in_place, static
        self.inputs = [a if s or not isinstance(a, torch.Tensor) else strided_copy(a) for a, s in zip(args, in_place)]
        self.addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
        self.shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
        # Warm-up outside capture: autotuning and lazy initialisation happen here. Its outputs are this call's
        # (`take_warm_outputs`): a function that advances its own inputs (the one-graph step) must run once per call.
        self.warm_outputs = fn(self.inputs)
        # What `with torch.cuda.graph(...)` does, less its torch.cuda.empty_cache() at every capture: hundreds of
        # captures in a row would each hand the allocator's cached blocks back to the driver, and the next
        # warm-up would allocate them again (vLLM captures with empty_cache disabled for the same reason).
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool=pool)
            try:
                self.outputs = fn(self.inputs)
            finally:
                self.graph.capture_end()

    def take_warm_outputs(self):
        """The warm-up run's outputs, once (then dropped: the graph keeps only its own)."""
        out, self.warm_outputs = self.warm_outputs, None
        return out

    def replay(self, args: list, check: bool, names=None):
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            where = f"{self.key} input {names[i] if names else i}"
            if check and tuple(a.shape) != self.shapes[i] and not self._grown(i, a):
                raise RuntimeError(
                    f"{where} has shape {tuple(a.shape)}, captured with {self.shapes[i]}; a padded shape must "
                    "replay only its own graph"
                )
            if a.data_ptr() == self.inputs[i].data_ptr():
                continue
            if self.in_place[i]:
                if check:
                    raise RuntimeError(
                        f"{where} was captured in place at {self.addresses[i]:#x} and now comes from "
                        f"{a.data_ptr():#x}: a parameter, KV cache or persistent buffer was reallocated after "
                        "capture, or the step passes a tensor other than the one captured"
                    )
                continue
            self.inputs[i].copy_(a)
        self.graph.replay()
        return self.outputs

    def _grown(self, i: int, a: torch.Tensor) -> bool:
        """Input i is a static tensor (a parameter or KV cache: CudaGraphs.static_ptrs) that grew along its first
        dimension at the same address, as a KV cache sized after capture does (runtime/growable.py); its address
        is checked below. Metadata views are not static: their shape must match."""
        return (
            self.static[i]
            and a.data_ptr() == self.addresses[i]
            and tuple(a.shape[1:]) == self.shapes[i][1:]
            and a.shape[0] >= self.shapes[i][0]
        )


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The process's one side stream for graph capture on the current device, shared by every engine.

    cuBLAS keeps a workspace per handle and stream for the life of the process (32 MiB on Hopper), allocated
    from the caching allocator at the first matmul on that stream. A stream per engine, first used inside a
    capture, put one workspace in each engine's graph pool that no close() could give back: every engine built
    in a process had 32 MiB less for its KV cache (tests/gpu/test_lifecycle_cuda.py). One stream, its workspace
    allocated here outside any capture (cuBLAS's and cuBLASLt's: a product with a bias takes the Lt path), pays
    that once, as the default stream does."""
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.ones(16, 16, device="cuda", dtype=dtype)
                torch.addmm(a[0], a, a)
                torch.mm(a, a)
        stream.synchronize()
        _CAPTURE_STREAMS[device] = stream
    return stream


@dataclass
class CudaGraphs:
    """An engine's CUDA graphs. `enabled`: graphs are captured at all (a CUDA device and a graph mode);
    `piece_graphs`: PIECEWISE graphs too (the mode has them)."""

    counters: CompileCounters
    enabled: bool
    piece_graphs: bool
    capture_sizes: tuple[int, ...]  # padded token counts with piece graphs
    check_addresses: bool = False  # debug: verify in-place inputs of piece graphs at every replay
    progress: bool = True
    allow_capture: bool = False  # eager capture, or every step with capture="lazy"
    pool: object = None
    graphs: dict[GraphKey, CapturedGraph] = field(default_factory=dict)
    static_ptrs: set = field(default_factory=set)  # parameters, buffers, KV caches: every graph reads in place
    # The metadata builders' persistent buffers: whole-forward graphs read their views in place (and refuse a
    # replay whose input moved). Piece graphs must not: a piece also runs on fresh on-device metadata (later
    # draft steps) that its capture would then never see.
    persistent_ptrs: set = field(default_factory=set)
    _in_whole_capture: int = 0
    _pieces: int = 0

    def new_piece_id(self) -> int:
        """An id for one piece runner (the piece part of its graphs' keys)."""
        self._pieces += 1
        return self._pieces

    # ---- what graphs read in place -------------------------------------------------------------------

    def register_static(self, tensors) -> None:
        self.static_ptrs.update(t.data_ptr() for t in tensors)

    def register_persistent(self, tensors) -> None:
        self.persistent_ptrs.update(t.data_ptr() for t in tensors)

    def graph_pool(self):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    # ---- running ---------------------------------------------------------------------------------------

    def piece_graphs_now(self) -> bool:
        """A piece at a capture size runs as a graph (never inside a whole-forward graph's capture: that graph
        holds the piece's kernels itself)."""
        return self.enabled and self.piece_graphs and not self._in_whole_capture

    def run_piece(self, key: GraphKey, code: Callable, args: list):
        """A piece graph at `key` (captured now when allowed), else the piece's code without a graph."""
        graph = self.graphs.get(key)
        if graph is None and self.allow_capture:
            static = [isinstance(a, torch.Tensor) and a.data_ptr() in self.static_ptrs for a in args]
            stray = [i for i, (a, s) in enumerate(zip(args, static)) if isinstance(a, torch.nn.Parameter) and not s]
            if stray:  # a parameter copied before every replay would be slow and double its memory
                raise RuntimeError(
                    f"{key}: inputs {stray} are parameters the engine did not register as static "
                    "(CudaGraphs.register_static); refusing to capture copies of weights"
                )
            graph = self._capture(key, lambda xs: code(*xs), list(args), static, static)
            graph.take_warm_outputs()  # pieces are replayed now (they write nothing but what the replay rewrites)
            self.counters.static_buffer_bytes += sum(
                a.numel() * a.element_size() for a, s in zip(args, static) if isinstance(a, torch.Tensor) and not s
            )
        if graph is None:
            self.counters.compiled_runs[key.name] += 1
            return code(*args)
        self.counters.graph_replays[key.name] += 1
        return graph.replay(list(args), self.check_addresses)

    def run_whole(self, key: GraphKey, inputs: dict, call: Callable[[dict], object]):
        """A whole-forward (or fused loop) graph at `key`: inputs a flat dict of tensors (or None)."""
        graph = self.graphs.get(key)
        names = list(inputs)
        if graph is None and self.allow_capture:
            in_place = self.static_ptrs | self.persistent_ptrs
            static = [v is not None and v.data_ptr() in in_place for v in inputs.values()]
            weights_and_caches = [v is not None and v.data_ptr() in self.static_ptrs for v in inputs.values()]

            def fn(xs):
                with self.whole_capture():
                    return call(dict(zip(names, xs)))

            graph = self._capture(key, fn, list(inputs.values()), static, weights_and_caches)
            # The warm-up before the capture ran this call already: its outputs are the call's, not a replay's
            # (a whole step advances its own inputs in place: replaying now would run it twice). Counted as the
            # graph's first run.
            self.counters.graph_replays[key.name] += 1
            return graph.take_warm_outputs()
        if graph is None:  # not captured (outside capture, or lazily not yet): the compiled code itself
            self.counters.compiled_runs[key.name] += 1
            return call(inputs)
        self.counters.graph_replays[key.name] += 1
        return graph.replay(list(inputs.values()), True, names)

    @contextlib.contextmanager
    def whole_capture(self):
        """While a whole-forward graph is warmed up and captured, pieces run their code, not their graphs."""
        self._in_whole_capture += 1
        try:
            yield
        finally:
            self._in_whole_capture -= 1

    @contextlib.contextmanager
    def capturing(self):
        """Capture allowed inside (eager capture); lazy capture sets `allow_capture` for good instead."""
        saved, self.allow_capture = self.allow_capture, True
        try:
            yield
        finally:
            self.allow_capture = saved

    def _capture(self, key: GraphKey, fn, args: list, in_place: list[bool], static: list[bool]) -> CapturedGraph:
        t0 = time.perf_counter()
        graph = CapturedGraph(key, fn, args, in_place, self.graph_pool(), static, capture_stream())
        self.counters.capture_seconds += time.perf_counter() - t0
        self.counters.graphs_captured += 1
        self.graphs[key] = graph
        return graph

    # ---- memory ----------------------------------------------------------------------------------------

    def memory_bytes(self) -> int | None:
        """Bytes held by the pool's segments (allocator snapshot), or None when it cannot be read. Free-memory
        deltas undercount: the caching allocator may already hold the memory a pool takes."""
        if self.pool is None:
            return 0
        try:
            segments = torch.cuda.memory._snapshot()["segments"]
        except Exception:  # an allocator without snapshots
            return None
        want = tuple(self.pool)
        return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id", ())) == want)

    def release(self) -> None:
        """Drop every graph and the pool, so their memory goes back (in-place registrations too: what they
        point at may be reallocated before the next capture)."""
        self.counters.graphs_released += len(self.graphs)
        self.graphs.clear()
        self.pool = None
        self.static_ptrs.clear()
        self.persistent_ptrs.clear()
        self.counters.graphs_captured = 0
        self.counters.static_buffer_bytes = 0
        self.counters.capture_seconds = 0.0


def strided_copy(a: torch.Tensor) -> torch.Tensor:
    """A static buffer with a's exact strides (compiled code asserts them; clone() would compact views)."""
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
