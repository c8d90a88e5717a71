"""A compiled function run from an artifact directory, without Dynamo or Inductor.

Each Dynamo trace of a function is stored as its split graph (pieces as FX graphs), the path each graph
input was read from (input_paths.py: steps over the entry point's locals, from Dynamo's `L['args'][0]`,
`L['fn'].__self__..._parameters['weight']`, `L['args'][0].size()[0]`, ...), and how the function's return
value is built from the graph's outputs. Loading swaps every compute piece for a `PieceRunner` over the
loaded compiled code; a call follows the input paths from its own arguments (an interpreter of the declared
steps, no eval), so it reads the model's parameters and the caller's tensors exactly as the traced code did.

Where a function has several traces (EAGLE-3's drafter: hidden width 3H at step 1, H later), the call
picks the trace whose static input shapes match, as Dynamo's guards did.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from draftgraph.artifacts.input_paths import from_call_args, readers
from draftgraph.compiler.cuda_graphs import CudaGraphs
from draftgraph.compiler.piece_runner import PieceRunner


class _PieceStub:
    def __init__(self, index: int, name: str):
        self.index, self.name = index, name


class LoadedTrace:
    def __init__(self, fn_name: str, module, record: dict, compiled: dict, ctx: CudaGraphs):
        self.module = module
        for i, p in enumerate(record["pieces"]):
            runner = PieceRunner(fn_name, _PieceStub(i, p["name"]), compiled[p["key"]], None, ctx, p["size_at"])
            setattr(module, p["name"], runner)
        module.recompile()
        self.read_inputs = readers(record["inputs"])  # a function of the call's locals
        self.static_shapes = [None if s is None else tuple(s) for s in record["static_shapes"]]
        # The caller's tensors (not parameters): what tells this trace from another of the same function.
        self.check = [i for i, steps in enumerate(record["inputs"]) if from_call_args(steps)]
        self.leaf_map = record["leaf_map"]
        self.spec = pytree.treespec_loads(record["treespec"])

    def matches(self, inputs: list) -> bool:
        for i in self.check:
            want, x = self.static_shapes[i], inputs[i]
            if want is None or not isinstance(x, torch.Tensor):
                continue
            if len(want) != x.dim() or any(w is not None and w != d for w, d in zip(want, x.shape)):
                return False
        return True

    def run(self, inputs: list):
        outs = self.module(*inputs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return pytree.tree_unflatten([outs[j] for j in self.leaf_map], self.spec)


class _NoTraces:
    """A loaded function's `backend`: it traced nothing (inspection and artifact builds read `records`)."""

    traces: list = []
    records: list = []


class LoadedFunction:
    """Called like the compiled function it replaces (positional arguments, or keywords for the loop);
    stands where CompiledTarget / CompiledDrafter / CompiledLoop stood."""

    backend = _NoTraces()

    def __init__(self, fn_name: str, fn, traces: list[LoadedTrace]):
        self.fn_name, self.fn, self.traces = fn_name, fn, traces

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        local = {"args": args, "kwargs": kwargs, "fn": self.fn}
        if len(self.traces) == 1:
            trace = self.traces[0]
            return trace.run(trace.read_inputs(local))
        for trace in self.traces:
            inputs = trace.read_inputs(local)
            if trace.matches(inputs):
                return trace.run(inputs)
        raise RuntimeError(
            f"{self.fn_name}: no stored trace matches the shapes of this call; the artifact was built for "
            "other input shapes (rebuild it with `draftgraph build`)"
        )
