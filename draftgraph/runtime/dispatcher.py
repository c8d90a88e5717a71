"""Which compiled artifact a batch runs on, and the padded shape it runs at.

A `BatchDescriptor` says what the real batch is (tokens, requests, and the query length when every
request has the same one). The dispatcher answers, in this order:
1. FULL, when the mode has full graphs, the batch is uniform with a query length that has full graphs
   (1 + K for verify and the first draft step, K + 2 for a draft model's first step, 1 for later draft
   steps and plain decode), and its padded request count was captured (bound: max_capture_reqs);
2. PIECEWISE, when the mode has piece graphs and the padded token count was captured
   (bound: max_capture_tokens);
3. NONE: compiled code without graphs at the real size (or eager in mode NONE). Never an error.
FULL and PIECEWISE dispatches say whether they run on a CUDA graph: not where graphs are off (the CPU,
use_cuda_graphs=False), where they run their compiled code at the padded size instead.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from draftgraph.compiler.config import FULL_MODES, PIECEWISE_MODES, CUDAGraphMode
from draftgraph.compiler.cuda_graphs import GraphKey


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int
    uniform_query_len: int | None  # every request has this many query tokens; None for mixed batches


@dataclass(frozen=True)
class Dispatch:
    runtime: str  # "FULL", "PIECEWISE" or "NONE"
    num_tokens: int  # padded
    num_reqs: int  # padded
    query_len: int | None = None  # FULL: every request's query length
    graph: bool = False  # runs on a CUDA graph (FULL / PIECEWISE with graphs captured)

    def graph_key(self, fn: str) -> GraphKey | None:
        """The key of `fn`'s graph for this batch (None when it runs without graphs)."""
        if self.runtime == "FULL":
            return GraphKey.full(fn, self.query_len, self.num_reqs)
        if self.runtime == "PIECEWISE":
            return GraphKey.piecewise(fn, self.num_tokens)
        return None

    @property
    def key(self) -> str:
        """What stats count this dispatch under: "full/q4/b8", "piecewise/t16" or "none"."""
        k = self.graph_key("")
        return "none" if k is None else k.dispatch


def _next(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class Dispatcher:
    def __init__(
        self,
        mode: CUDAGraphMode,
        piecewise_sizes: tuple[int, ...],
        full_reqs: tuple[int, ...] = (),
        full_query_lens: tuple[int, ...] = (),
        graphs: bool = False,
    ):
        self.mode, self.graphs = mode, graphs
        self.piecewise_sizes = tuple(sorted(piecewise_sizes)) if mode in PIECEWISE_MODES else ()
        self.full_reqs = tuple(sorted(full_reqs)) if mode in FULL_MODES else ()
        self.full_query_lens = tuple(sorted(full_query_lens)) if mode in FULL_MODES else ()

    def dispatch(self, desc: BatchDescriptor) -> Dispatch:
        q = desc.uniform_query_len
        if q is not None and q in self.full_query_lens:
            b = _next(self.full_reqs, desc.num_reqs)
            if b is not None:
                return Dispatch("FULL", b * q, b, q, self.graphs)
        t = _next(self.piecewise_sizes, desc.num_tokens)
        if t is not None:
            return Dispatch("PIECEWISE", t, desc.num_reqs, None, self.graphs)
        return Dispatch("NONE", desc.num_tokens, desc.num_reqs)

    def padded_tokens(self, num_tokens: int) -> int:
        """The PIECEWISE padding alone (for callers with no request structure)."""
        return _next(self.piecewise_sizes, num_tokens) or num_tokens
