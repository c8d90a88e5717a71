"""draftgraph's own Triton kernels compiled side by side, before the traced code first launches them.

A cold start used to JIT-compile draftgraph's Triton kernels (attention, split-KV, sampling, argmax, ...) at
their first launch, one after another in the engine process: 14-19 s of the built-in pair's 31-40 s cold
start on an H100 (docs/history/benchmarks-2026-11.md, 2026-11-23). A traced graph names every call of our custom ops
with its arguments' shapes, strides and dtypes and its constant arguments. `op_calls(gm)` writes each distinct call as
data. `KernelsAhead` runs each once, in a thread of its own, on zero-filled tensors of that layout inside
`ops.launch.compiling_ahead()` and Triton's AsyncCompileMode: the op's launch sites then queue the compile of
every kernel variant the call would launch on a thread pool and launch nothing. Triton's compiles overlap in
threads (code generation, LLVM, ptxas, and the C launcher built here too: 4x on 8 threads), and
the traced code's first launch of a variant waits for that variant only (Triton's kernel cache holds its
pending compile). A kernel whose variant the data does not reach (a size the trace leaves symbolic and that a
launcher specialises on) compiles at its first launch, as before.

Zero inputs are valid for every op listed: index tensors point at slot, block and expert 0, lengths are 0
(padding rows), temperatures 0 (greedy rows); nothing launches anyway. A call that cannot be written as data,
or that would need a large tensor (a KV cache, expert weights) in full, shrinks its first dimension or is
left out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from draftgraph.compiler.piece_inputs import symbol_hint, symbol_range
from draftgraph.ops.launch import compiling_ahead

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
        "rms_norm",
        "add_rms_norm",
        "linear",
        "rope_qkv",
        "silu_mul_linear",
        "add_rms_norm_linear",
        "rope_qkv_write",
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
        hint = symbol_hint(env, s)
        if hint is None:  # unbacked: an example size inside its range
            lo, hi = symbol_range(env, s)
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


def op_calls(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",), skipped: list | None = None) -> list[dict]:
    """Each distinct call of a KERNEL_OPS op in this graph module (its submodules included) whose tensors are on
    `devices`, as JSON-ready data ({"op", "args", "kwargs"}); `skipped` collects why other calls were left out."""
    calls, seen = [], set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for n in module.graph.nodes:
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
            except _Skip as e:
                if skipped is not None:
                    skipped.append(f"{target.name()}: {e}")
                continue
            key = json.dumps(call, sort_keys=True)
            if key not in seen:
                seen.add(key)
                calls.append(call)
    return calls


def tensor_arg(shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    """A contiguous tensor argument of an op call written by hand (as `op_calls` writes one from a graph)."""
    stride, step = [], 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= max(n, 1)
    return {"tensor": {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "stride": stride, "offset": 0}}


def op_call(op: str, *args) -> dict:
    """One call of `op` ("namespace::name") with these arguments (`tensor_arg`s, ints, floats), for code that
    knows a call before any graph names it (the runtime's eager sampling: runtime/warmup.py)."""
    return {"op": op, "args": list(args), "kwargs": {}}


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
    """Run one call written by `op_calls` on zero-filled inputs (on CUDA on a stream of its own, waited for).
    Inside `compiling_ahead()` it compiles the call's kernels and launches none."""
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


def async_compile_mode():
    """Triton's AsyncCompileMode class, or None where this Triton has none (then nothing compiles ahead)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


class KernelsAhead:
    """Compiles the kernels of op calls (`op_calls`) on `threads` threads, each distinct call once per engine
    build; `close()` (end of the compile phase) waits for every compile and returns what was done."""

    def __init__(self, device: str, threads: int):
        mode = async_compile_mode()
        if mode is None:
            raise RuntimeError("this Triton has no AsyncCompileMode")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # threads need the index to set it
            self.device = torch.device("cuda", torch.cuda.current_device())
        init = (torch.cuda.set_device, (self.device,)) if self.device.type == "cuda" else (None, ())
        self.pool = ThreadPoolExecutor(threads, "draftgraph-kernels", initializer=init[0], initargs=init[1])
        self.mode = mode(self.pool)
        self.queue: queue.Queue = queue.Queue()
        self.seen: set[str] = set()
        self.calls = self.failed = self.kernels = 0
        self.skipped: list[str] = []  # op calls left out, with why
        self.error = ""  # what stopped the thread, if anything did
        self.thread = threading.Thread(target=self._run, name="draftgraph-kernels-ahead", daemon=True)
        self.thread.start()

    def submit_graph(self, gm: torch.fx.GraphModule) -> threading.Event:
        """Queue the distinct calls of our ops in a traced graph (`op_calls`). The event is set once they ran,
        i.e. every kernel compile they name is queued: the traced code's first launches, after it, then wait
        for those compiles instead of compiling the same kernels again in the engine's thread."""
        self.submit(op_calls(gm, skipped=self.skipped))
        queued = threading.Event()
        self.queue.put(queued)
        return queued

    def submit(self, calls: list[dict]) -> None:
        for call in calls:
            key = json.dumps(call, sort_keys=True)
            if key not in self.seen:
                self.seen.add(key)
                self.queue.put(call)

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            _triton_key()
            with self.mode:
                while (call := self.queue.get()) is not None:
                    if isinstance(call, threading.Event):
                        call.set()
                    else:
                        self._compile(call)
            # leaving the mode waited for every compile
        except Exception as e:  # not fatal: what did not compile here compiles at its first launch
            self.error = f"{type(e).__name__}: {e}"
            log.warning("compiling draftgraph's kernels ahead stopped (%s); they compile at first launch", e)
            while (item := self.queue.get()) is not None:  # let close() and the traced code through
                if isinstance(item, threading.Event):
                    item.set()

    def _compile(self, call: dict) -> None:
        futures = getattr(self.mode, "raw_futures", [])
        before = len(futures)
        try:
            with compiling_ahead():
                run_op_call(call, str(self.device))
            self.calls += 1
        except Exception as e:  # not fatal: the call's kernels compile at their first launch
            self.failed += 1
            log.info("compiling %s's kernels ahead failed (%s); they compile at first launch", call["op"], e)
        for f in futures[before:]:
            self.kernels += 1
            f.add_done_callback(_load)

    def close(self) -> dict:
        """Wait for every queued call's compiles; returns {"calls", "kernels", "failed", "skipped"[, "error"]}."""
        self.queue.put(None)
        self.thread.join()
        self.pool.shutdown(wait=True)
        out = {
            "calls": self.calls,
            "kernels": self.kernels,
            "failed": self.failed,
            "skipped": sorted(set(self.skipped)),
        }
        if self.error:
            out["error"] = self.error
        return out


def _triton_key() -> None:
    """Triton's cache key of its own build (a hash of its sources and its 300+ MB compiler library; cached per
    process): 0.7 s of an H100 warm start in the engine thread at its first kernel launch
    (docs/history/benchmarks-2026-11.md, 2026-11-23). Hashing releases the GIL, so here it overlaps the engine
    thread's loading and tracing."""
    with contextlib.suppress(Exception):  # an internal of Triton's; where it is missing, nothing is lost
        from triton.runtime.cache import triton_key

        triton_key()


def _load(future) -> None:
    """A compiled kernel's launcher (Triton's C module: a C compiler run) and its module on the device, built in
    the compiling thread rather than at the engine's first launch."""
    if future.cancelled() or future.exception() is not None:
        return  # the first launch compiles it again and reports the error
    init = getattr(future.result(), "_init_handles", None)
    if init is not None:
        with contextlib.suppress(Exception):  # the first launch retries and reports
            init()
