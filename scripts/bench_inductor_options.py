"""Inductor settings side by side: step time of the 1B-shaped pair in FULL mode (one graph per step).

For each variant of `CompileConfig.inductor_options`, plain decode and the K = 4 speculative step at each batch
size: median wall ms of engine.step(), the floor ratio, and from a profiler pass the kernels per step and
the GPU busy share (kernel time over the span of kernels).

Variants: "default" = draftgraph's defaults (compiler/inductor_options.py), "no-split" = split_reductions off,
"combo" = combo_kernels on (independent pointwise kernels launched as one), "no-autotune" = one config per
pointwise kernel (no first-call benchmarking: faster cold start), "addmm" = without draftgraph's post-grad pass
(residual adds fused into cuBLAS addmm, passes/unfuse_addmm.py). A variant may repeat (default,addmm,default,addmm):
each run builds its engines afresh, so repeats show the drift.

Usage: python scripts/bench_inductor_options.py [--sizes 1,32] [--variants default,no-split,combo,no-autotune]
"""

from __future__ import annotations

import argparse

import torch

from scripts.bench_full import step_time
from scripts.bench_piecewise import build_pair, copy_bandwidth, layer_bytes, target_layer_bytes
from scripts.profile_step import engine, profile

VARIANTS = {
    "default": None,
    "no-split": (("split_reductions", False),),
    "combo": (("combo_kernels", True),),
    "no-autotune": (("triton.autotune_pointwise", False),),
    # Inductor's own post-grad choice: residual adds fused into cuBLAS addmm (passes/unfuse_addmm.py left out)
    "addmm": (("post_grad_custom_post_pass", None),),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,32")
    ap.add_argument("--variants", default="default,no-split,combo,no-autotune")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    k, ctx = args.k, args.context
    target, drafter = build_pair()
    bw = copy_bandwidth()
    head = target.head_weight.numel() * target.head_weight.element_size()
    t_bytes, d_bytes = target_layer_bytes(target) + head, layer_bytes(drafter) + head
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {bw / 1e9:.0f} GB/s; ctx {ctx}, K={k}")
    hdr = f"{'variant':>9} {'kind':>5} {'B':>4} | {'ms/step':>8} {'floor':>6} {'ratio':>6} | {'kernels':>7} {'busy':>5}"
    print(hdr)
    for name in args.variants.split(","):
        for kind, d in (("plain", None), ("spec", drafter)):
            for b in sizes:
                eng = engine(target, d, b, k, ctx, VARIANTS[name])
                ms, _ = step_time(eng, b, k, ctx)
                kv = 2 * b * ctx * target.cfg.num_kv_heads * target.cfg.head_dim * 2
                floor = (t_bytes + target.cfg.num_layers * kv) / bw * 1e3
                if d is not None:
                    floor += k * (d_bytes + kv) / bw * 1e3
                s = profile(eng, b, ctx)
                busy = sum(s.kernel_us.values()) / max(s.span_us, 1e-9)
                kernels = sum(s.kernel_calls.values()) / max(s.steps, 1)
                print(
                    f"{name:>9} {kind:>5} {b:>4} | {ms:>8.3f} {floor:>6.3f} {ms / floor:>6.2f} | {kernels:>7.0f} "
                    f"{busy:>5.0%}",
                    flush=True,
                )
                del eng
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
