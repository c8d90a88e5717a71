"""Qwen3.5-shaped ~1B model (3 Gated DeltaNet : 1 gated attention), bf16, random weights, on CUDA.

Target: hidden 2048, 16 layers (12 GDN, 4 attention), GDN 16 k / 16 v heads of 128 (conv kernel 4), attention
8 q heads / 2 kv heads of 256 (output gate, partial RoPE), MLP 6144, vocabulary 32k, untied head: 1.04 B
parameters. Drafter: the MTP head in its checkpoint layout (one gated-attention layer; random, so
acceptance is about zero: compare step costs, not speed-ups).

1. Step: wall ms of engine.step() in steady decode (mode FULL, one graph per step), plain (K = 0) and MTP
   (K = 3), batch 1 and 32 at `--context` cached tokens, against the step's floor: bytes read or written
   once over the measured copy bandwidth (target layers + LM head; per GDN layer and request one state read
   and one written per verified position, fp32; the attention KV; K x the MTP layer + LM head + its KV).
2. The gated_delta_net op alone (one layer's shapes, replayed as a CUDA graph so that launch time does not
   count, as inside the engine): decode (1 token) and verify (1 + K tokens) at batch 1 and 32, ours (conv +
   recurrent kernels) against the PyTorch reference, with the state-traffic floor. With --fla-recurrent also
   fla's fused recurrent kernel, eager (our conv kernel, the state gathered, fla, the final state scattered;
   it keeps no per-position states, so it does less than the op).
3. A single prefill run of 128 / 512 / 2048 tokens: our recurrent kernel alone against fla's chunked heads
   (chunked.CHUNK_MIN_RUN is the crossover).

Usage: python scripts/bench_qwen3_5.py [--context 512] [--k 3] [--fla-recurrent]   (fla-core for the fla columns)
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
import triton

import draftgraph as dg
from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.linear_attention import chunked
from draftgraph.ops.linear_attention.reference import gated_delta_net_reference
from draftgraph.ops.linear_attention.triton_gdn import conv_forward, gated_delta_net_triton
from scripts.bench_full import step_time
from scripts.bench_piecewise import copy_bandwidth, layer_bytes, target_layer_bytes
from scripts.bench_sparse_mla import graph_ms

SHAPE = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192,
    tie_word_embeddings=False,
)  # fmt: skip
SIZES = (1, 32)


def build():
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).to(torch.bfloat16).eval()
    target = CausalLM.from_hf(hf, attn_impl="triton")
    del hf
    return target, builtin_drafter("mtp", target)


def engine(target, drafter, k, ctx):
    cfg = dg.CompileConfig(
        speculation="fixed",
        mode="FULL", num_speculative_tokens=k, max_num_seqs=max(SIZES), max_num_batched_tokens=2048,
        max_model_len=ctx + 96, device="cuda", gpu_memory_utilization=0.0, progress=False, full_capture_sizes=SIZES,
    )  # fmt: skip
    t0 = time.perf_counter()
    eng = dg.compile_model(target, drafter, cfg)
    print(f"{'MTP' if drafter else 'plain'}: ready in {time.perf_counter() - t0:.1f} s  {eng.warm_up_report}")
    return eng


def state_bytes(cfg) -> int:
    la = cfg.hybrid.linear
    return la.num_v_heads * la.head_k_dim * la.head_v_dim * 4


def step_floor_ms(target, drafter, b, k, ctx, bw) -> float:
    cfg = target.cfg
    gdn = len(cfg.hybrid.linear_layers)
    attn = cfg.num_layers - gdn
    kv = b * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # one attention layer's K and V, bf16
    head = target.head_weight.numel() * target.head_weight.element_size()
    total = target_layer_bytes(target) + head + attn * kv + gdn * b * (2 + k) * state_bytes(cfg)
    if drafter is not None:
        total += k * (layer_bytes(drafter) + head + kv)
    return total / bw * 1e3


def timed(fn) -> float:
    """Median ms of eager calls (host launch time included where the GPU waits on it)."""
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def layer_case(b, q, ring, cfg, ctx=64):
    """One GDN layer's op inputs: b requests of q tokens at position ctx, random state rings (bf16 x)."""
    la = cfg.hybrid.linear
    t, dev = b * q, "cuda"
    x = torch.randn(t, la.conv_dim, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(t, la.num_v_heads, device=dev) * 0.2
    beta = torch.rand(t, la.num_v_heads, device=dev)
    w = torch.randn(la.conv_dim, la.conv_kernel, device=dev, dtype=torch.bfloat16) * 0.3
    conv = torch.randn(b + 1, ring + la.conv_kernel - 2, la.conv_dim, device=dev, dtype=torch.bfloat16)
    ssm = torch.randn(b + 1, ring, la.num_v_heads, la.head_k_dim, la.head_v_dim, device=dev) * 0.05
    i32 = dict(dtype=torch.int32, device=dev)
    meta = (torch.arange(b, device=dev), torch.arange(b + 1, **i32) * q, torch.arange(b, **i32).repeat_interleave(q),
            (ctx + 1 + torch.arange(q, **i32)).repeat(b))  # fmt: skip
    return (x, g, beta, w, conv, ssm, *meta), la


def fla_recurrent(args, la):
    """fla's fused recurrent rule behind our conv kernel: gather the state before each run, scatter the last."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    x, g, beta, w, conv_states, ssm, rows, qsl, req, kvl = args
    hk, dk = la.num_k_heads, la.head_k_dim
    ring, t = ssm.shape[1], x.shape[0]
    entry = (kvl[qsl[:-1].long()].long() - 2) % ring
    last = (kvl[qsl[1:].long() - 1].long() - 1) % ring

    def run():
        c = conv_forward(x, w, conv_states, rows, qsl, req, kvl)
        q, k = c[:, : hk * dk].view(1, t, hk, dk), c[:, hk * dk : 2 * hk * dk].view(1, t, hk, dk)
        v = c[:, 2 * hk * dk :].view(1, t, la.num_v_heads, la.head_v_dim)
        o, final = fused_recurrent_gated_delta_rule(
            q, k, v, g[None], beta[None], scale=dk**-0.5, initial_state=ssm[rows, entry], output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=qsl.long(),
        )  # fmt: skip
        ssm[rows, last] = final
        return o

    return run


def kernel_table(cfg, k, bw, fla_rec: bool):
    print(f"\ngated_delta_net op, one layer (HV {cfg.hybrid.linear.num_v_heads}, Dk = Dv 128, bf16 x, fp32 states)")
    hdr = f"{'B':>3} {'q':>2} | {'ours':>7} {'ref':>7} {'fla rec':>7} {'floor':>6} {'ours/fl':>7} {'ref/ours':>8}"
    print(hdr + "   (microseconds)")
    print("-" * len(hdr))
    fla_rec = fla_rec and chunked.fla_chunk_fn() is not None
    for b in SIZES:
        for q in (1, 1 + k):
            args, la = layer_case(b, q, 1 + k, cfg)
            ours = graph_ms(lambda a=args: gated_delta_net_triton(*a, chunk_fn=None)) * 1e3
            ref = graph_ms(lambda a=args: gated_delta_net_reference(*a)) * 1e3
            rec = timed(fla_recurrent(args, la)) * 1e3 if fla_rec else float("nan")
            floor = b * (1 + q) * state_bytes(cfg) / bw * 1e6
            print(f"{b:>3} {q:>2} | {ours:>7.1f} {ref:>7.1f} {rec:>7.1f} {floor:>6.1f} {ours / floor:>7.2f} "
                  f"{ref / ours:>8.2f}")  # fmt: skip


def prefill_table(cfg):
    if chunked.fla_chunk_fn() is None:
        print("\nprefill: fla-core not installed, skipped")
        return
    print("\none prefill run, one layer: recurrent kernel alone vs fla's chunked head + kernel tail (microseconds)")
    for n in (128, 512, 2048):
        args, _ = layer_case(1, n, 4, cfg, ctx=0)
        ours = timed(lambda a=args: gated_delta_net_triton(*a, chunk_fn=None)) * 1e3
        fla = timed(lambda a=args: gated_delta_net_triton(*a, chunk_fn=chunked.fla_chunk_fn(), min_run=1)) * 1e3
        print(f"  n {n:>5}: kernel {ours:>8.1f}  fla {fla:>8.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fla-recurrent", action="store_true", help="time fla's fused recurrent kernel too (eager; "
                    "it hit an illegal memory access on the H100 on 2026-11-23, cause not found)")  # fmt: skip
    args = ap.parse_args()
    k, ctx = args.k, args.context
    target, mtp = build()
    bw = copy_bandwidth()
    params = sum(p.numel() for p in target.parameters())
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; target {params / 1e9:.2f} B parameters, context {ctx}, K={k}; fla "
        f"{'installed' if chunked.fla_chunk_fn() else 'absent'}"
    )
    engines = {"plain": engine(target, None, 0, ctx), "MTP": engine(target, mtp, k, ctx)}
    hdr = f"{'':>5} {'B':>3} | {'step ms':>8} {'floor':>6} {'step/fl':>7} {'accepted':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, eng in engines.items():
        kk = 0 if name == "plain" else k
        for b in SIZES:
            ms, acc = step_time(eng, b, kk, ctx)
            floor = step_floor_ms(target, mtp if kk else None, b, kk, ctx, bw)
            print(f"{name:>5} {b:>3} | {ms:>8.3f} {floor:>6.3f} {ms / floor:>7.2f} {acc:>8.2f}")
        s = eng.stats()
        print(f"  {name}: fallbacks {s['fallbacks']}, forwards by graph {s['dispatch']}")
    kernel_table(target.cfg, k, bw, args.fla_recurrent)
    prefill_table(target.cfg)


if __name__ == "__main__":
    main()
