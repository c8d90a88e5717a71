"""draftgraph's own kernels compiled side by side, before the traced code first calls them.

A cold start JIT-compiles draftgraph's Triton kernels (attention, split-KV, sampling, argmax, ...) at their
first call, one after another: on an H100 about 1.5 s per kernel variant, a third of the built-in pair's cold
start (docs/benchmarks.md, session 11). A traced graph names every call of our custom ops with its arguments'
shapes, strides and dtypes and its constant arguments. `op_calls(graphs)` writes each distinct call as data;
`KernelWarmer` runs each once, in threads, on zero-filled tensors of the same layout on a side stream, which
compiles the kernels the call launches (Triton's compiler and launcher builds run ptxas and the C compiler in
subprocesses, so threads overlap). The piecewise backend waits for them before the traced code first runs,
which then finds its kernels compiled. Kernels whose variant depends on a size the trace leaves symbolic (the
split count of split-KV decode at other batch sizes) may still compile at their first call, as before.
(Compile worker processes were tried for this first: their start, imports included, took longer than the
compiles they would save; docs/benchmarks.md, session 11.)

Zero inputs are valid for every op listed: index tensors point at slot, block and expert 0, lengths are 0
(padding rows), temperatures 0 (greedy rows). A call that cannot be written as data, or that would need a
large tensor (a KV cache, expert weights) in full, shrinks its first dimension or is left out: the engine
process then compiles that kernel itself, as without workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from draftgraph.compiler.piece_inputs import _bound

# The custom ops that launch draftgraph's Triton kernels and run on one GPU with nothing but their inputs
# (collectives need a process group; the piece boundary launches nothing).
KERNEL_OPS = frozenset(
    {
        "paged_attention",
        "mla_attention",
        "sparse_mla_attention",
        "indexer_topk",
        "gated_delta_net",
        "argmax_rows",
        "sampling_probs",
        "moe_experts",
    }
)
log = logging.getLogger("draftgraph")
MAX_TENSOR_BYTES = 256 * 2**20  # a larger input keeps only as many rows of its first dimension as fit
UNBACKED_SIZE = 16  # the token count is unbacked in a trace (no example value): an example size


class _Skip(Exception):
    pass


def _int(d, env) -> int:
    if not isinstance(d, torch.SymInt):
        return int(d)
    expr = d.node.expr
    if expr.is_number:
        return int(expr)
    values = {}
    for s in expr.free_symbols:
        hint = env.backed_var_to_val.get(s) if hasattr(env, "backed_var_to_val") else env.var_to_val.get(s)
        if hint is None:  # unbacked: an example size inside its range
            vr = env.var_to_range.get(s)
            lo, hi = (None, None) if vr is None else (_bound(vr.lower), _bound(vr.upper))
            hint = max(UNBACKED_SIZE, lo or 0)
            if hi is not None:
                hint = min(hint, hi)
        values[s] = hint
    return int(expr.xreplace(values))


def _tensor(v: torch.Tensor, devices: tuple[str, ...]) -> dict:
    if v.layout != torch.strided or v.device.type not in devices:
        raise _Skip(f"a {v.layout} tensor on {v.device}")
    env = next((d.node.shape_env for d in (*v.shape, *v.stride()) if isinstance(d, torch.SymInt)), None)
    shape = [_int(d, env) for d in v.shape]
    stride = [_int(d, env) for d in v.stride()]
    offset = _int(v.storage_offset(), env)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if extent * v.element_size() > MAX_TENSOR_BYTES:
        if not shape or stride[0] != max(stride) or offset:
            raise _Skip(f"a large tensor {shape} that cannot shrink along its first dimension")
        shape[0] = max(1, shape[0] * MAX_TENSOR_BYTES // (extent * v.element_size()))
    return {"dtype": str(v.dtype).removeprefix("torch."), "shape": shape, "stride": stride, "offset": offset}


def _value(a, devices: tuple[str, ...]):
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val", a.meta.get("example_value"))
        if isinstance(v, torch.Tensor):
            return {"tensor": _tensor(v, devices)}
        if isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
            env = v.node.shape_env if isinstance(v, torch.SymInt) else None
            return _int(v, env)
        raise _Skip(f"an argument of type {type(v).__name__}")
    if isinstance(a, (list, tuple)):
        return {"list": [_value(x, devices) for x in a]}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise _Skip(f"a constant of type {type(a).__name__}")


def op_calls(graphs, devices: tuple[str, ...] = ("cuda",)) -> list[dict]:
    """Each distinct call of a KERNEL_OPS op in these FX graphs whose tensors are on `devices`, as JSON-ready
    data ({"op", "args", "kwargs"})."""
    calls, seen = [], set()
    for graph in graphs:
        for n in graph.nodes:
            target = n.target
            if isinstance(target, torch._ops.OpOverloadPacket):  # as Dynamo writes calls
                target = target.default
            if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                continue
            namespace, name = target._schema.name.split("::")
            if namespace != "draftgraph" or name not in KERNEL_OPS:
                continue
            try:
                call = {
                    "op": target.name(),
                    "args": [_value(a, devices) for a in n.args],
                    "kwargs": {k: _value(a, devices) for k, a in n.kwargs.items()},
                }
            except _Skip:
                continue
            key = json.dumps(call, sort_keys=True)
            if key not in seen:
                seen.add(key)
                calls.append(call)
    return calls


def _materialize(a, device):
    if isinstance(a, dict) and "tensor" in a:
        t = a["tensor"]
        shape, stride, offset = t["shape"], t["stride"], t["offset"]
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset
        buf = torch.zeros(max(extent, 1), dtype=getattr(torch, t["dtype"]), device=device)
        return buf.as_strided(shape, stride, offset)
    if isinstance(a, dict) and "list" in a:
        return [_materialize(x, device) for x in a["list"]]
    return a


def run_op_call(call: dict, device: str) -> None:
    """Run one call written by `op_calls` on zero-filled inputs (on CUDA on a stream of its own, waited for)."""
    namespace, rest = call["op"].split("::")
    name, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    on_cuda = torch.device(device).type == "cuda"
    stream = torch.cuda.Stream(device) if on_cuda else None
    with torch.no_grad(), torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
        args = [_materialize(a, device) for a in call["args"]]
        kwargs = {k: _materialize(a, device) for k, a in call["kwargs"].items()}
        op(*args, **kwargs)
    if on_cuda:
        stream.synchronize()


class KernelWarmer:
    """Runs op calls (`op_calls`) in `threads` threads, each distinct call once per engine build."""

    def __init__(self, device: str, threads: int):
        self.device, self.threads = device, threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="draftgraph-kernels")
        self.runs: dict[str, Future] = {}
        self.done = 0

    def submit(self, calls: list[dict]) -> list[Future]:
        futures = []
        for call in calls:
            key = json.dumps(call, sort_keys=True)
            if key not in self.runs:
                self.runs[key] = self.pool.submit(run_op_call, call, self.device)
                futures.append(self.runs[key])
        return futures

    def wait(self, futures: list[Future]) -> float:
        """Wait for these runs; returns the seconds waited. A failed run is not fatal: the traced code's first
        call compiles that kernel, as without the warmer."""
        t0 = time.perf_counter()
        for f in futures:
            try:
                f.result()
                self.done += 1
            except Exception as e:
                log.info("compiling an op's kernels ahead failed (%s); they compile at its first call", e)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
