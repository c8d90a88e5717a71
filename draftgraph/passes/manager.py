"""PassManager: runs the named passes in one documented order, optionally dumping before/after graphs.

Order (see passes/README.md):
  1. drop_size_asserts  remove the always-true "unbacked size >= 0" runtime asserts
  2. dce                drop unused nodes
  3. split_attention    cut at the attention op into pieces (always last: it changes the graph's shape)
"""

from __future__ import annotations

import hashlib
import os

from torch import fx

from draftgraph.passes.base import GraphPass
from draftgraph.passes.dce import DeadCodeElimination
from draftgraph.passes.drop_size_asserts import DropSizeAsserts
from draftgraph.passes.split_attention import SplitGraph, split_at_attention


class PassManager:
    def __init__(self, passes: list[GraphPass] | None = None, dump_dir: str | None = None):
        self.passes = passes if passes is not None else [DropSizeAsserts(), DeadCodeElimination()]
        self.dump_dir = dump_dir

    def uuid(self) -> str:
        """Cache identity of the whole pipeline: every pass's source, and the splitter's."""
        import draftgraph.passes.split_attention as split_mod

        h = hashlib.sha256()
        for p in self.passes:
            h.update(f"{p.name}:{p.uuid()}".encode())
        with open(split_mod.__file__, "rb") as f:
            h.update(f.read())
        return h.hexdigest()[:16]

    def run(self, gm: fx.GraphModule, fn_name: str) -> SplitGraph:
        for i, p in enumerate(self.passes):
            self._dump(gm, fn_name, f"{i:02d}_before_{p.name}")
            gm = p(gm)
        self._dump(gm, fn_name, f"{len(self.passes):02d}_before_split_attention")
        split = split_at_attention(gm)
        self._dump(split.module, fn_name, f"{len(self.passes):02d}_after_split_attention")
        return split

    def _dump(self, gm: fx.GraphModule, fn_name: str, stage: str) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        with open(os.path.join(self.dump_dir, f"{fn_name}.{stage}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))
