"""A compile worker process: `python -m draftgraph.compiler.compile_worker` (started by compile_pool.py).

It reads one job per line on stdin (JSON: a piece's FX graph as fx_serialize writes it, its inputs as
piece_inputs writes them, the Inductor settings, the file to write), compiles the piece with Inductor the
way the tracing process would (token count symbolic), saves the compiled artifact to the file and answers
one line on its protocol channel: {"id", "ok", "seconds"} or {"id", "ok": false, "error"}. Anything else
the compile prints goes to stderr (the pool sends it to a log file), never into the protocol.

Each job names the draftgraph modules the tracing process has imported; the worker imports the ones it
lacks, which registers every custom op a graph may call. At start it compiles one small graph on its
device, so that the one-time costs of a first compile (Inductor's registrations, Triton's first build) are
paid while the tracing process is still loading weights and tracing, and imports the modules the tracing
process had when it started the worker (DRAFTGRAPH_COMPILE_MODULES), for the same reason.
"""

from __future__ import annotations

import importlib
import json
import os
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
    gm = decode_module(job["graph"])
    mode, fakes = rebuild_inputs(job["inputs"])
    example_values(gm, mode, fakes)
    options = tuple((k, v) for k, v in job["options"])
    with torch.no_grad(), torch._guards.tracing(torch._guards.TracingContext(mode)), inductor_patch(options):
        art = standalone_compile(gm, fakes, dynamic_shapes="from_tracing_context")
    art.save(path=job["out"], format="binary")
    return time.perf_counter() - t0


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel: the original stdout
    os.dup2(2, 1)  # everything else printed to stdout (Python or C) goes to stderr
    sys.stdout = sys.stderr
    import torch

    torch.set_grad_enabled(False)
    device = os.environ.get("DRAFTGRAPH_COMPILE_DEVICE", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    ready = {"id": None, "ok": True}
    try:
        t0 = time.perf_counter()
        prewarm(device)
        ready["seconds"] = time.perf_counter() - t0
    except Exception as e:  # not fatal: the first job pays the costs instead
        ready["error"] = f"prewarm failed: {e!r}"
    t1 = time.perf_counter()
    for name in filter(None, os.environ.get("DRAFTGRAPH_COMPILE_MODULES", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # not fatal here: a job that needs the module imports it and reports
            ready["error"] = f"import of {name} failed: {e!r}"
    ready["import_seconds"] = time.perf_counter() - t1
    proto.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        try:
            reply = {"id": job["id"], "ok": True, "seconds": compile_job(job)}
        except Exception as e:
            traceback.print_exc()
            reply = {"id": job["id"], "ok": False, "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
