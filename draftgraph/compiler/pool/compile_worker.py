"""The compile workers: `python -m draftgraph.compiler.pool.compile_worker` (started by compile_pool.py).

That process is the workers' parent. It lowers its priority (DRAFTGRAPH_COMPILE_NICE: the engine process's
imports and tracing are the start's critical path, the workers' start is not), imports torch, Inductor's compile
path and the engine's draftgraph modules once (DRAFTGRAPH_COMPILE_MODULES: that registers every custom op a graph
may call), makes no CUDA call, and forks DRAFTGRAPH_COMPILE_FORKS workers; then it only reaps them. Each worker
connects to the pool's socket (DRAFTGRAPH_COMPILE_ADDRESS), says who it is ({"index", "pid"}) and waits for the
pool's go (one line: a pool started before the engine process imported torch holds its workers until those
imports are done, compile_pool.CompilePool.release); then it takes its device, compiles one small graph there
(so that a first compile's one-time costs are paid while the engine still loads weights and traces) and says it
is ready ({"phases": seconds of imports, modules, held, cuda, prewarm}).

Then it reads one job per line (JSON: a piece's FX graph as fx_serialize writes it, its inputs as
piece_inputs writes them, the Inductor settings, the file to write), compiles the piece with Inductor the
way the tracing process would (token count symbolic), saves the compiled artifact to the file and answers
one line: {"id", "ok", "seconds"} or {"id", "ok": false, "error"}. Anything the compile prints goes to the
pool's log file, never into the protocol. A job names the draftgraph modules the tracing process has imported
by then; the worker imports the ones it lacks.

Eight workers each importing all of this side by side took 20 s to be ready on 16 cores; one import and
forks take a fraction (docs/history/benchmarks-2026-11.md, 2026-11-23).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import time
import traceback


def prewarm(device: str) -> None:
    """One small symbolic-size compile on `device` (pays the first compile's fixed costs now)."""
    import torch
    from torch._inductor import standalone_compile

    def f(x, w):
        return (torch.nn.functional.silu(x @ w) * x).sum(-1, keepdim=True) + 1

    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(8, 64, device=device)
    torch._dynamo.mark_dynamic(x, 0)
    art = standalone_compile(gm, [x, torch.randn(64, 64, device=device)], dynamic_shapes="from_example_inputs")
    art(x, torch.randn(64, 64, device=device))


def example_values(gm, mode, fakes) -> None:
    """Each node's fake value in `meta["example_value"]`, as Dynamo leaves it (Inductor's cache reads it)."""
    import torch
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]


def compile_job(job: dict) -> float:
    import torch
    from torch._inductor import standalone_compile

    from draftgraph.compiler.fx_serialize import decode_module
    from draftgraph.compiler.inductor_options import inductor_patch
    from draftgraph.compiler.piece_inputs import rebuild_inputs

    t0 = time.perf_counter()
    for name in job.get("modules", ()):  # where the graph's custom ops are registered
        if name not in sys.modules:
            importlib.import_module(name)
    from draftgraph.ops.collectives.op import register_group_sizes

    register_group_sizes(job.get("group_sizes", {}))  # the tracing process's groups, for the collectives' fakes
    gm = decode_module(job["graph"])
    mode, fakes = rebuild_inputs(job["inputs"])
    example_values(gm, mode, fakes)
    options = tuple((k, v) for k, v in job["options"])
    with torch.no_grad(), torch._guards.tracing(torch._guards.TracingContext(mode)), inductor_patch(options):
        art = standalone_compile(gm, fakes, dynamic_shapes="from_tracing_context")
    art.save(path=job["out"], format="binary")
    return time.perf_counter() - t0


def preimport() -> None:
    """What every worker's compile imports (torch, Inductor's compile path and Triton), done once in the parent
    before it forks; none of it makes a CUDA call."""
    import torch
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.graph  # noqa: F401
    from torch._inductor import standalone_compile  # noqa: F401

    from draftgraph.compiler import fx_serialize, inductor_options, piece_inputs  # noqa: F401

    with contextlib.suppress(ImportError):  # the GPU path's code generation and Triton's compiler
        import torch._inductor.codegen.triton  # noqa: F401
        import triton.compiler  # noqa: F401
    torch.set_grad_enabled(False)


def import_modules() -> str:
    """The engine's draftgraph modules (DRAFTGRAPH_COMPILE_MODULES); returns an error message or ''."""
    error = ""
    for name in filter(None, os.environ.get("DRAFTGRAPH_COMPILE_MODULES", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # not fatal here: a job that needs the module imports it and reports
            error = f"import of {name} failed: {e!r}"
    return error


def start(device: str, phases: dict) -> dict:
    """This worker's device and prewarm; returns its ready message."""
    import torch

    ready = {"id": None, "ok": True, "phases": phases}
    t0 = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # initialises CUDA in this process
    phases["cuda"] = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        prewarm(device)
        phases["prewarm"] = time.perf_counter() - t1
    except Exception as e:  # not fatal: the first job pays the costs instead
        ready["error"] = f"prewarm failed: {e!r}"
    return ready


def serve(reader, writer, ready: dict) -> None:
    """The ready message, then one reply per job line until the pool closes the channel."""
    writer.write(json.dumps(ready) + "\n")
    writer.flush()
    for line in reader:
        job = json.loads(line)
        try:
            reply = {"id": job["id"], "ok": True, "seconds": compile_job(job)}
        except Exception as e:
            traceback.print_exc()
            reply = {"id": job["id"], "ok": False, "error": f"{type(e).__name__}: {e}"}
        writer.write(json.dumps(reply) + "\n")
        writer.flush()


def child(index: int, address: str, device: str, phases: dict) -> None:
    """A forked worker: connect to the pool, say who it is, wait for the pool's go, start, serve."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    reader, writer = conn.makefile("r", encoding="utf-8"), conn.makefile("w", encoding="utf-8")
    writer.write(json.dumps({"index": index, "pid": os.getpid()}) + "\n")
    writer.flush()
    phases = dict(phases)
    t0 = time.perf_counter()
    if not reader.readline():  # the go (CompilePool.release), or the pool closed: nothing to do
        return
    phases["held"] = time.perf_counter() - t0
    serve(reader, writer, start(device, phases))


def main() -> None:
    """The parent: imports once, forks DRAFTGRAPH_COMPILE_FORKS workers, reaps them, exits after the last."""
    t0 = time.perf_counter()
    sys.stdout = sys.stderr  # stdout and stderr both go to the pool's log; the protocol is the socket
    device = os.environ.get("DRAFTGRAPH_COMPILE_DEVICE", "cpu")
    address = os.environ["DRAFTGRAPH_COMPILE_ADDRESS"]
    forks = int(os.environ.get("DRAFTGRAPH_COMPILE_FORKS", "1"))
    nice = int(os.environ.get("DRAFTGRAPH_COMPILE_NICE", "0") or 0)
    if nice > 0:  # below the engine process: its imports and tracing first (the forks and their helpers inherit it)
        with contextlib.suppress(OSError):
            os.nice(nice)
    preimport()
    phases = {"imports": time.perf_counter() - t0}
    t1 = time.perf_counter()
    error = import_modules()
    phases["modules"] = time.perf_counter() - t1
    if error:
        print(error, file=sys.stderr, flush=True)
    import torch

    if torch.cuda.is_initialized():  # a fork would inherit CUDA's state, which CUDA forbids
        raise RuntimeError("the compile workers' parent initialized CUDA before forking (an import did)")
    sys.stderr.flush()
    children = []
    for i in range(forks):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(i, address, device, phases)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    for _ in children:
        with contextlib.suppress(ChildProcessError):
            os.wait()


if __name__ == "__main__":
    main()
