"""Which import makes a later fork unable to use CUDA? Imports what the compile workers' parent imports, one
step at a time; after each, a forked child tries CUDA. Also runs one compile pool and prints its log.

Usage: python scripts/check_fork_cuda.py
"""

from __future__ import annotations

import importlib
import os
import sys


def child_can_use_cuda() -> str:
    pid = os.fork()
    if pid == 0:
        try:
            import torch

            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            os._exit(0)
        except BaseException as e:
            print(f"      child: {type(e).__name__}: {str(e)[:200]}", flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return "ok" if status == 0 else "FAILS"


def main() -> None:
    if os.environ.get("NVML") == "1":  # before torch's import, as the compile workers' parent has it
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    steps = ["torch", "torch._inductor.compile_fx", "torch._inductor.graph", "torch._inductor.codegen.triton",
             "triton.compiler", "draftgraph.compiler.compile_worker", "draftgraph.compiler.build",
             "draftgraph.models.llama", "draftgraph.runtime.engine", "draftgraph.api"]  # fmt: skip
    for name in steps:
        importlib.import_module(name)
        import torch

        print(f"after import {name}: torch.cuda initialized {torch.cuda.is_initialized()}; fork child CUDA "
              f"{child_can_use_cuda()}", flush=True)  # fmt: skip
    sys.stdout.flush()
    import time

    from draftgraph.compiler.compile_pool import CompilePool

    pool = CompilePool(2, "cuda:0", progress=False)
    t0 = time.time()
    while time.time() - t0 < 90 and (len(pool.workers) < 2 or any(w.ready_s is None for w in pool.workers)):
        if pool._all_dead():
            break
        time.sleep(0.2)
    print("pool:", pool.timeline(), flush=True)
    print("pool log tail:\n" + pool.log_tail(40), flush=True)
    pool.close()


if __name__ == "__main__":
    main()
