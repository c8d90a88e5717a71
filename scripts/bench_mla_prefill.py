"""MLA's two forms on the GPU: absorbed against decompressed for prefill-shaped batches, and what "auto"
picks. DeepSeek-V3's ranks: KV LoRA 512, RoPE 64, no-RoPE 128, V 128; bf16; block size 16.

1. The op (`torch.ops.draftgraph.mla_attention`, Triton kernels, cache write included) for one request
   of R new rows (fresh prefill, or a chunk after 4096 cached tokens), a batch of 8 prompts, and a
   2048-row chunk sharing its step with 63 decode rows; 16 and 128 heads. Each time sits next to its
   compute floor: the form's flops (causal pairs only) over the measured bf16 matmul rate.
2. The DeepSeek-V3-shaped model of bench_deepseek.py (hidden 2048, 8 layers, 64 experts / 6 active, 16
   heads), an eager prefill forward in each form: what the choice is worth once MoE and projections count.

Medians of triton.testing.do_bench. Usage: python scripts/bench_mla_prefill.py [--skip-model]
"""

from __future__ import annotations

import argparse

import torch
import triton

import draftgraph.ops.splitting  # noqa: F401  (registers the attention ops)
from draftgraph.ops.mla.forms import DEFAULT_COST, plan_mla
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice

RANK, ROPE, NOPE, HEAD_V, BLOCK = 512, 64, 128, 128, 16
FORMS = ("absorbed", "decompressed", "auto")


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def matmul_rate() -> float:
    """Measured bf16 matmul flops/s (8192^3): the compute ceiling the floors divide by."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ a)
    return 2 * 8192**3 / (ms * 1e-3)


def build_meta(reqs: list[tuple[int, int]], builder: MetadataBuilder):
    """reqs: (cached, new rows) per request; contiguous block tables, one after another."""
    slices, first = [], 0
    for cached, rows in reqs:
        n = -(-(cached + rows) // BLOCK)
        slices.append(RequestSlice(list(range(first, first + n)), cached, rows))
        first += n
    meta, _ = builder.build(slices)
    return meta, first


def flops(reqs, heads, form) -> float:
    """Causal (row, key) pairs times the per-pair work of the form, plus its per-row or per-key matmuls."""
    pairs = sum(sum(cached + i + 1 for i in range(rows)) for cached, rows in reqs)
    rows = sum(r for _, r in reqs)
    keys = sum(c + r for c, r in reqs)
    if form == "absorbed":
        return heads * (pairs * 2 * (2 * RANK + ROPE) + rows * 2 * RANK * (NOPE + HEAD_V))
    return heads * (pairs * 2 * (NOPE + ROPE + HEAD_V) + keys * 2 * RANK * (NOPE + HEAD_V))


def op_cases():
    fresh = [(f"prefill {r}", [(0, r)]) for r in (16, 64, 128, 256, 512, 1024, 2048, 4096)]
    chunks = [(f"chunk {r} @4096", [(4096, r)]) for r in (64, 256, 1024)]
    return (
        fresh + chunks + [("8 x prefill 512", [(0, 512)] * 8), ("chunk 2048 + 63 dec", [(0, 2048)] + [(2048, 1)] * 63)]
    )


def op_row(name, reqs, heads, w_kv_b, builder, g, rate) -> str:
    meta, blocks = build_meta(reqs, builder)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    latent, rope = torch.randn(blocks, BLOCK, RANK, **bf16), torch.randn(blocks, BLOCK, ROPE, **bf16)
    t = meta.num_tokens
    q_nope, q_pe = torch.randn(t, heads, NOPE, **bf16), torch.randn(t, heads, ROPE, **bf16)
    c, pe = torch.randn(t, RANK, **bf16), torch.randn(t, ROPE, **bf16)

    def run(form):
        return torch.ops.draftgraph.mla_attention(
            q_nope, q_pe, c, pe, latent, rope, w_kv_b, meta.slot_mapping, meta.block_tables, meta.token_req,
            meta.token_kv_len, 0.07, form, "triton",
        )  # fmt: skip

    ref = run("absorbed").float()
    for f in FORMS[1:]:
        torch.testing.assert_close(run(f).float(), ref, atol=3e-2, rtol=3e-2)
    ms = {f: timed(lambda f=f: run(f)) for f in FORMS}
    busy = {f: gpu_ms(lambda f=f: run(f)) for f in FORMS[:2]}
    plan = plan_mla("auto", DEFAULT_COST, heads, meta.block_tables, meta.token_req, meta.token_kv_len, BLOCK, 64)
    pick = "A" if plan is None else ("A+D" if plan.absorbed_rows.numel() else "D")
    fl = {f: flops(reqs, heads, f) / rate * 1e3 for f in FORMS[:2]}
    a, d = ms["absorbed"], ms["decompressed"]
    return (
        f"{name:>20} {heads:>4} | {a:>9.3f} {a / fl['absorbed']:>5.1f} | {d:>9.3f} {d / fl['decompressed']:>5.1f} | "
        f"{a / d:>7.2f} | {ms['auto']:>9.3f} {pick:>4} {ms['auto'] / min(a, d):>9.2f} | {busy['absorbed']:>7.3f} "
        f"{busy['decompressed']:>7.3f} {busy['absorbed'] / busy['decompressed']:>7.2f}"
    )


def bench_op(rate: float):
    builder = MetadataBuilder(8192, 64, 512, BLOCK, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(
        f"\n1. the op; auto's cost model: {DEFAULT_COST}\nms (median); x = time / compute floor; auto's pick: "
        "A absorbed, D decompressed, A+D split by request;\nwall times of small cases are the op's eager launch "
        "time; GPU = profiler sum of the op's kernels; the plan (one host read per forward) is reused across calls"
    )
    hdr = (
        f"{'case':>20} {'H':>4} | {'absorbed':>9} {'x':>5} | {'decomp':>9} {'x':>5} | {'abs/dec':>7} | "
        f"{'auto':>9} {'pick':>4} {'auto/best':>9} | {'GPU abs':>7} {'GPU dec':>7} {'abs/dec':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for heads in (16, 128):
        w_kv_b = torch.randn(heads * (NOPE + HEAD_V), RANK, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        for name, reqs in op_cases():
            print(op_row(name, reqs, heads, w_kv_b, builder, g, rate), flush=True)


MODEL_CASES = [
    ("prefill 512", [(0, 512)]),
    ("prefill 2048", [(0, 2048)]),
    ("4 x prefill 1024", [(0, 1024)] * 4),
    ("chunk 1024 @3072", [(3072, 1024)]),
]


def model_row(model, name, reqs, builder) -> str:
    from draftgraph.models.deepseek import set_mla_form
    from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache

    cfg = model.cfg
    meta, blocks = build_meta(reqs, builder)
    spec = KVCacheSpec(cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, cfg.kv_entry_shapes)
    cache = PagedKVCache(spec, "cuda")
    ids = torch.randint(0, 32000, (meta.num_tokens,), device="cuda")
    pos = torch.cat([torch.arange(c, c + r, device="cuda") for c, r in reqs])

    def forward():
        with torch.no_grad():
            return model(ids, pos, meta, cache.layers)

    ms, busy = {}, {}
    for form in FORMS:
        set_mla_form(model, form)
        ms[form] = timed(forward)
        busy[form] = gpu_ms(forward)
    a, d, auto = ms["absorbed"], ms["decompressed"], ms["auto"]
    return (
        f"{name:>20} | {a:>9.3f} {d:>9.3f} {auto:>9.3f} {a / auto:>8.2f} | {busy['absorbed']:>9.3f} "
        f"{busy['decompressed']:>9.3f} {busy['auto']:>9.3f} {busy['absorbed'] / busy['auto']:>8.2f}"
    )


def gpu_ms(fn, iters: int = 5) -> float:
    """Milliseconds the GPU spends in kernels and copies per call (profiler sum): the forward's device
    work, whatever the host's launch overhead."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def bench_model():
    import transformers

    from draftgraph.models.causal_lm import CausalLM
    from scripts.bench_deepseek import SHAPE

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).to(torch.bfloat16).eval()
    model = CausalLM.from_hf(hf, attn_impl="triton")
    del hf
    builder = MetadataBuilder(8192, 64, 512, BLOCK, "cuda")
    print(
        f"\n2. eager prefill forward of the {model.cfg.num_layers}-layer DeepSeek-V3-shaped model, ms: wall (median; "
        "eager launches bound it) | GPU busy (profiler sum of kernels per forward)"
    )
    hdr = (
        f"{'case':>20} | {'absorbed':>9} {'decomp':>9} {'auto':>9} {'abs/auto':>8} | {'absorbed':>9} {'decomp':>9} "
        f"{'auto':>9} {'abs/auto':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, reqs in MODEL_CASES:
        print(model_row(model, name, reqs, builder), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    rate = matmul_rate()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")  # fmt: skip
    bench_op(rate)
    if not args.skip_model:
        bench_model()


if __name__ == "__main__":
    main()
