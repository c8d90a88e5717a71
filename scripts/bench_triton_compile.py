"""Do Triton compiles overlap in threads of one process? N variants of a small attention-like kernel (each a
new constexpr, so each a full compile: Python code generation, MLIR, LLVM, ptxas, and the C launcher on the
first launch) compiled one after another, then in N threads through Triton's AsyncCompileMode (when this
Triton has it), each from an empty Triton cache. Prints both walls and their ratio: near 1 means the compiles
hold the GIL, near N means they overlap.

Usage: python scripts/bench_triton_compile.py [--variants 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def make_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(q_ptr, k_ptr, o_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * D + d).to(tl.float32)
        acc = tl.zeros([D], tl.float32)
        m = -float("inf")
        s = 0.0
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            k = tl.load(k_ptr + offs[:, None] * D + d[None, :], mask=offs[:, None] < n, other=0.0).to(tl.float32)
            x = tl.sum(k * q[None, :], 1) * SCALE
            x = tl.where(offs < n, x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            p = tl.exp(x - m_new)
            s = s * tl.exp(m - m_new) + tl.sum(p, 0)
            acc = acc * tl.exp(m - m_new) + tl.sum(p[:, None] * k, 0)
            m = m_new
        tl.store(o_ptr + row * D + d, acc / s)

    return probe_kernel


def fresh_cache() -> None:
    os.environ["TRITON_CACHE_DIR"] = path = tempfile.mkdtemp(prefix="triton-probe-")
    try:
        from triton import knobs

        knobs.cache.dir = path
    except (ImportError, AttributeError):  # older Triton reads the environment variable
        pass


def run(kernel, variants: int, threads: bool) -> float:
    import torch

    q = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    o = torch.empty(4, 64, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if threads:
        from triton.runtime._async_compile import AsyncCompileMode

        with ThreadPoolExecutor(variants) as pool, AsyncCompileMode(pool):
            for i in range(variants):
                kernel.warmup(q, k, o, 256, SCALE=0.125 + i, BLOCK=32, D=64, grid=(4,))
    for i in range(variants):  # launches: the C launcher builds here if the warm-up did not
        kernel[(4,)](q, k, o, 256, SCALE=0.125 + i, BLOCK=32, D=64)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=int, default=8)
    args = ap.parse_args()
    import triton

    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401

        has_async = True
    except ImportError:
        has_async = False
    print(f"triton {triton.__version__}, AsyncCompileMode: {has_async}, cores {os.cpu_count()}")
    fresh_cache()
    serial = run(make_kernel(), args.variants, threads=False)
    print(f"{args.variants} variants one after another: {serial:.2f} s")
    if has_async:
        fresh_cache()
        threaded = run(make_kernel(), args.variants, threads=True)
        print(f"{args.variants} variants in threads (AsyncCompileMode): {threaded:.2f} s ({serial / threaded:.2f}x)")


if __name__ == "__main__":
    main()
