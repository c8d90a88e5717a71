"""Which compiled artifact a batch runs on, and the padded size it runs at.

PIECEWISE: a batch of T tokens runs at the smallest capture size >= T while T <= max_capture_tokens
(graph pieces for that size), else at T itself on the dynamic-shape compiled pieces. NONE: no padding.
"""

from __future__ import annotations

import bisect

from draftgraph.compiler.config import CUDAGraphMode


class Dispatcher:
    def __init__(self, mode: CUDAGraphMode, capture_sizes: tuple[int, ...]):
        self.mode = mode
        self.sizes = tuple(sorted(capture_sizes)) if mode != CUDAGraphMode.NONE else ()

    def padded_tokens(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else num_tokens
