"""Per-step latency on a Llama-3.2-1B-shaped target with an EAGLE head: eager vs compiled without graphs vs
PIECEWISE (compiled pieces as CUDA graphs, Triton attention between them).

Target: 16 layers, hidden 2048, 32 query / 8 KV heads (head_dim 64), intermediate 8192, vocabulary
128256, random weights, bf16. Drafter: a 1-layer EAGLE head of the same shape (upstream key names,
random weights). Decode batches of B requests with `--context` cached tokens each.

Rows: B in 1..256. Columns: the target forward of B decode tokens, and the drafter's K steps as the
engine runs them (first step over B x (1 + K) rows, then K - 1 steps of B rows: forward, logits over the
full vocabulary, argmax, positions/slots advanced on the device), each with its bandwidth floor: the
bytes it must read once (weights, KV cache; the LM head for every draft step) over the measured
device-to-device copy bandwidth. Medians of CUDA-event timings.
Usage: python scripts/bench_piecewise.py [--sizes 1,8,64,256] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch
import transformers
import triton

import draftgraph as dg
from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.runtime.attn_metadata import RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor
from draftgraph.runtime.sampler import SamplingTensors

SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)


@functools.cache
def _hf_target(device: str):
    cfg = transformers.LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def build_pair(device="cuda", ops: OpChoices = DEFAULT_OPS):
    """The 1B-shaped target and its EAGLE head, their layers using the kernels `ops` names; a pair for other
    ops shares the target's weights with the first (one transformers model, referenced)."""
    target = CausalLM.from_hf(_hf_target(device), attn_impl="triton", ops=ops)
    h, inter, q, kv = 2048, 8192, 32 * 64, 8 * 64
    g = torch.Generator(device=device).manual_seed(1)

    def r(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

    state = {
        "fc.weight": r(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": r(q, h),
        "layers.0.self_attn.k_proj.weight": r(kv, h),
        "layers.0.self_attn.v_proj.weight": r(kv, h),
        "layers.0.self_attn.o_proj.weight": r(h, q),
        "layers.0.mlp.gate_proj.weight": r(inter, h),
        "layers.0.mlp.up_proj.weight": r(inter, h),
        "layers.0.mlp.down_proj.weight": r(h, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
    }
    holder = module_from_state_dict(state)  # a module with the upstream EAGLE names
    drafter = load_drafter(holder, target, kind="eagle")
    return target, drafter


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def layer_bytes(model) -> int:
    """Bytes of every parameter but the embedding (a tied LM head is the embedding, so it is left out too)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def target_layer_bytes(model) -> int:
    """Bytes the target forward reads once: its decoder layers and final norm (not the LM head, which
    compute_logits applies afterwards to the sampled rows only)."""
    return sum(p.numel() * p.element_size() for m in (model.layers, model.norm) for p in m.parameters())


class Bench:
    """Decode batches of B requests at `context` cached tokens, through one engine's runner."""

    def __init__(self, engine, context: int, k: int):
        self.engine, self.runner, self.context, self.k = engine, engine.runner, context, k

    def inputs(self, b: int):
        r = self.runner
        bs = r.shape.block_size
        per = math.ceil((self.context + 2 * self.k + 2) / bs)
        slices = [RequestSlice(list(range(i * per, (i + 1) * per)), self.context, 1) for i in range(b)]
        padded = r.dispatcher.padded_tokens(b)
        meta, pos = r.target_meta.build(slices, num_tokens_padded=padded, num_reqs_padded=b)
        ids = torch.randint(0, 1000, (padded,), device="cuda")
        return meta, pos, ids

    def target_step(self, b):
        meta, pos, ids = self.inputs(b)
        fn = self.runner.target_fn
        return lambda: fn(ids, pos, meta, self.runner.target_cache.layers)

    def draft_steps(self, b):
        """The drafter's K steps for b decode requests as the engine runs them (Proposer.run_loop): the first
        step over b x (1 + K) verify rows, the choice at each request's last row, then K - 1 single-row
        steps with the on-device advance; the fused one-graph loop where the engine has it."""
        r = self.runner
        p, k, q = r.proposer, self.k, r.proposer.first_q
        per = math.ceil((self.context + 2 * k + 2) / r.shape.block_size)
        slices = [RequestSlice(list(range(i * per, (i + 1) * per)), self.context, q) for i in range(b)]
        d1 = r.dispatcher.dispatch(BatchDescriptor(b * q, b, q))
        meta, pos = r.target_meta.build(slices, num_tokens_padded=d1.num_tokens, num_reqs_padded=d1.num_reqs)
        tok = torch.randint(0, 1000, (d1.num_tokens,), device="cuda")
        hidden = torch.randn(d1.num_tokens, r.drafter.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        sample_rows = torch.arange(b, device="cuda") * q + (q - 1)  # every draft accepted: the last row
        zeros = torch.zeros(b, device="cuda")
        st = SamplingTensors(zeros, zeros.long(), zeros + 1, zeros.long(), (True,) * b)
        rows = list(range(b))
        return lambda: p.run_loop(d1, tok, pos, hidden, meta, sample_rows, rows, rows, st)


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    k, ctx = args.k, args.context
    t0 = time.perf_counter()
    target, drafter = build_pair()
    print(f"built the pair in {time.perf_counter() - t0:.1f} s")
    bw = copy_bandwidth()
    max_b = max(sizes)
    base = dict(
        num_speculative_tokens=k,
        max_num_seqs=max_b,
        max_num_batched_tokens=max_b * (k + 1),
        max_model_len=ctx + 64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        capture_sizes=tuple(sorted({s * q for s in sizes for q in (1, k + 1)})),
        progress=False,
    )
    engines = {}
    for name, extra in (
        ("eager", dict(mode="NONE")),
        ("compiled", dict(mode="PIECEWISE", use_cuda_graphs=False)),
        ("piecewise", dict(mode="PIECEWISE")),
    ):
        t1 = time.perf_counter()
        engines[name] = dg.compile_model(target, drafter, dg.CompileConfig(speculation="fixed", **base, **extra))
        print(f"{name}: ready in {time.perf_counter() - t1:.1f} s  {engines[name].warm_up_report}")
    t_bytes, d_bytes = target_layer_bytes(target), layer_bytes(drafter)
    head_bytes = target.head_weight.numel() * target.head_weight.element_size()
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"copy bandwidth {bw / 1e9:.0f} GB/s; target layer weights {t_bytes / 1e9:.2f} GB, EAGLE layer "
        f"{d_bytes / 1e6:.0f} MB, LM head {head_bytes / 1e6:.0f} MB; context {ctx}, K={k}"
    )
    hdr = (
        f"{'B':>4} | {'target: eager':>13} {'compiled':>9} {'piecewise':>9} {'floor':>7} {'pw/floor':>8} | "
        f"{'draft x K: eager':>16} {'compiled':>9} {'piecewise':>9} {'floor':>7} {'pw/floor':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        kv_read = 2 * b * ctx * 8 * 64 * 2  # K and V, bf16, per layer
        t_floor = (t_bytes + 16 * kv_read) / bw * 1e3
        d_floor = k * (d_bytes + head_bytes + kv_read) / bw * 1e3
        row_t = [timed(Bench(engines[n], ctx, k).target_step(b)) for n in ("eager", "compiled", "piecewise")]
        row_d = [timed(Bench(engines[n], ctx, k).draft_steps(b)) for n in ("eager", "compiled", "piecewise")]
        print(
            f"{b:>4} | {row_t[0]:>13.3f} {row_t[1]:>9.3f} {row_t[2]:>9.3f} {t_floor:>7.3f} "
            f"{row_t[2] / t_floor:>8.2f} | {row_d[0]:>16.3f} {row_d[1]:>9.3f} {row_d[2]:>9.3f} {d_floor:>7.3f} "
            f"{row_d[2] / d_floor:>8.2f}"
        )
    c = engines["piecewise"].compiled.counters
    print(
        f"\npiecewise counters: graphs captured {c.graphs_captured}, replays {sum(c.graph_replays.values())}, "
        f"compiled runs without graph {sum(c.compiled_runs.values())}, dynamic runs {sum(c.dynamic_runs.values())}"
    )


if __name__ == "__main__":
    main()
