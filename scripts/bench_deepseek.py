"""DeepSeek-V3-shaped small model with its MTP drafter: verify and the K-step MTP loop, PIECEWISE vs FULL.

Target: hidden 2048, 8 layers (the first dense), 16 heads, MLA ranks as in V3 (q LoRA 1536, KV LoRA 512,
no-RoPE 128 + RoPE 64 per head, V 128), 64 routed experts of 1408 with 6 active in 8 groups (4 picked),
one shared expert, vocabulary 32k, bf16, random weights. Drafter: an MTP layer (MLA + MoE block) in the
DeepSeek checkpoint layout, reused for K steps.

Per batch size B (B requests at `--context` cached tokens), medians of CUDA-event timings:
1. verify (B x (1 + K) tokens): PIECEWISE vs FULL;
2. the K MTP steps as the engine runs them (first step over the verify rows, then K - 1 single-row
   steps): K PIECEWISE replays vs the fused FULL loop.
Each next to its bandwidth floor: the bytes the step must read once (every non-expert weight, the routed
experts the batch's tokens actually chose, counted per MoE layer from their routing, and the latent KV
cache) over the measured copy bandwidth.

Usage: python scripts/bench_deepseek.py [--sizes 1,4,16,64] [--k 3] [--context 512]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
import triton

from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.moe import MoE, route
from scripts.bench_full import compile_engines, timed, verify_batch, verify_fn
from scripts.bench_piecewise import Bench, copy_bandwidth

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build_pair():
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for m in hf.modules():  # spread the routing: a random router with zero bias picks near-uniformly
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.01)
    target = CausalLM.from_hf(hf, attn_impl="triton")
    return target, builtin_drafter("mtp", target)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def non_expert_bytes(module) -> int:
    return sum(
        p.numel() * p.element_size() for n, p in module.named_parameters() if not n.endswith(("gate_up", "down"))
    )


def routed_expert_bytes(moe: MoE, x: torch.Tensor) -> int:
    """Bytes of the distinct experts the rows of `x` route to in `moe` (what a grouped matmul must read)."""
    c = moe.m
    _, ids = route(
        torch.nn.functional.linear(x.float(), moe.gate.float()), moe.e_score_correction_bias, c.top_k, c.n_group,
        c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
    )  # fmt: skip
    per_expert = (moe.gate_up[0].numel() + moe.down[0].numel()) * moe.gate_up.element_size()
    return int(ids.unique().numel()) * per_expert


class ExpertCounter:
    """Sums routed_expert_bytes over every MoE layer's real input rows during an eager forward."""

    def __init__(self, model, rows: int):
        self.bytes, self.rows, self.hooks = 0, rows, []
        for m in model.modules():
            if isinstance(m, MoE):
                self.hooks.append(m.register_forward_pre_hook(self.count))

    def count(self, m, args):
        self.bytes += routed_expert_bytes(m, args[0][: self.rows])

    def close(self):
        for h in self.hooks:
            h.remove()


def floors(engine, b, k, ctx, bw):
    """(verify floor ms, K-step loop floor ms, experts read in verify)."""
    r = engine.runner
    target, drafter = r.target, r.drafter
    q = k + 1
    kv_layer = b * ctx * (512 + 64) * 2  # latent + RoPE key, bf16, per layer
    counter = ExpertCounter(target, b * q)
    _, ids, pos, meta = verify_batch(engine, b, k, ctx)
    with torch.no_grad():
        target(ids, pos, meta, r.target_cache.layers)  # eager: the hooks see the routing
    counter.close()
    verify_bytes = non_expert_bytes(target.layers) + nbytes(target.norm.parameters()) + counter.bytes
    verify_bytes += target.cfg.num_layers * kv_layer
    head = target.head_weight.numel() * target.head_weight.element_size()
    experts = sum(
        routed_expert_bytes(
            drafter.block.mlp, torch.randn(rows, target.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        )
        for rows in [b * q] + [b] * (k - 1)
    )
    loop_bytes = k * (non_expert_bytes(drafter) + head + kv_layer) + experts
    return verify_bytes / bw * 1e3, loop_bytes / bw * 1e3, counter.bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    k, ctx = args.k, args.context
    t0 = time.perf_counter()
    target, drafter = build_pair()
    print(f"built the pair in {time.perf_counter() - t0:.1f} s")
    bw = copy_bandwidth()
    modes = {"piecewise": dict(mode="PIECEWISE"), "full": dict(mode="FULL", fuse_draft_loop=True)}
    engines = compile_engines(target, drafter, modes, sizes, k, ctx, min_batched_tokens=512)
    weights = nbytes(target.parameters())
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; target weights {weights / 1e9:.2f} GB (all experts), MTP layer "
        f"{nbytes(drafter.parameters()) / 1e9:.2f} GB; context {ctx}, K={k}; milliseconds (median)"
    )
    hdr = (
        f"{'B':>3} | {'verify pw':>9} {'FULL':>7} {'floor':>6} {'FULL/fl':>7} {'pw/FULL':>7} {'experts GB':>10} | "
        f"{'MTP xK pw':>9} {'fused':>7} {'floor':>6} {'fused/fl':>8} {'pw/fused':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        v_floor, d_floor, expert_bytes = floors(engines["full"], b, k, ctx, bw)
        v, dr = {}, {}
        for name in ("piecewise", "full"):
            fn, runtime = verify_fn(engines[name], b, k, ctx)
            v[name] = timed(fn)
            assert runtime == ("FULL" if name == "full" else "PIECEWISE"), runtime
            dr[name] = timed(Bench(engines[name], ctx, k).draft_steps(b))
        print(
            f"{b:>3} | {v['piecewise']:>9.3f} {v['full']:>7.3f} {v_floor:>6.3f} {v['full'] / v_floor:>7.2f} "
            f"{v['piecewise'] / v['full']:>7.2f} {expert_bytes / 1e9:>10.2f} | {dr['piecewise']:>9.3f} "
            f"{dr['full']:>7.3f} {d_floor:>6.3f} {dr['full'] / d_floor:>8.2f} {dr['piecewise'] / dr['full']:>8.2f}"
        )
    hits = engines["full"].stats()["dispatch"]
    assert any("/loop/" in key for key in hits), hits  # the fused loop ran
    s = engines["full"].stats()
    print(f"\nFULL engine: fallbacks {s['fallbacks']}, forwards by artifact {s['dispatch']}")


if __name__ == "__main__":
    main()
