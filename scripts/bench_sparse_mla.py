"""DeepSeek-V3.2 sparse MLA on CUDA: a decode step of a V3.2-shaped layer stack, sparse vs dense MLA on the same
weights, and the kernels alone, each next to its floor.

Stack: 4 layers of hidden 2048, 16 heads, q LoRA 1536, KV LoRA 512, no-RoPE 128 + RoPE 64, V 128 (V3's MLA),
the lightning indexer at V3.2's sizes (64 heads of 128, top-2048), a small dense MLP (intermediate 1408, so
attention is a visible share of the step), bf16, random weights, block size 16. Dense = the same weights
without the indexer (DeepSeek-V3 MLA, `mla_attention`, absorbed). B requests of `--context` cached tokens
(random caches) each add `--qlens` query tokens (1: decode; 4: verify at K = 3).

1. Step: the stack's forward (embedding to final norm, no LM head) captured as one CUDA graph, median of
   replays. Floor: the bytes it must read once over the measured copy bandwidth: every layer weight, plus per
   layer and request the latent + RoPE rows it attends (dense: the whole context, 1152 B a token; sparse:
   min(topk, context) picks per query row, and the index keys of the whole context, 256 B a token).
2. Kernels alone, per layer, each checked against its reference once: the indexer (write + score + select;
   then score and select alone), sparse MLA's latent kernel over the picks, and dense MLA's latent kernel over
   the whole context. Timed as one CUDA graph over `copies` cache copies (so the keys of one launch are not in
   L2 from the last), per launch.

Usage: python scripts/bench_sparse_mla.py [--batches 1,32] [--context 4096] [--qlens 1,4] [--layers 4]
"""

from __future__ import annotations

import argparse
import math

import torch
import transformers
import triton

from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.mla.reference import mla_latent_reference
from draftgraph.ops.mla.triton_latent import mla_latent_triton
from draftgraph.ops.sparse_mla.reference import indexer_topk_reference, sparse_mla_latent_reference
from draftgraph.ops.sparse_mla.triton_indexer import (
    choose_score_splits,
    indexer_topk_triton,
    score_rows,
    select_rows,
)
from draftgraph.ops.sparse_mla.triton_sparse_mla import sparse_mla_latent_triton
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache
from scripts.bench_decode_attention import copy_bandwidth

BLOCK, TOPK, RANK, ROPE, IDX_HEADS, IDX_DIM = 16, 2048, 512, 64, 64, 128
SHAPE = dict(
    vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=1536, kv_lora_rank=RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE, v_head_dim=128,
    first_k_dense_replace=64, mlp_layer_types=None, index_topk=TOPK, index_n_heads=IDX_HEADS,
    index_head_dim=IDX_DIM, max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip
COPY_BYTES = 1 << 30  # cache copies of the kernel timings: about this many bytes in all, at most 16


def build_models(layers: int):
    """(sparse V3.2 stack, dense V3 stack on the same weights), bf16 on CUDA."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV32Config(**SHAPE, num_hidden_layers=layers)
    with torch.device("cuda"):
        hf = transformers.DeepseekV32ForCausalLM(cfg).to(torch.bfloat16).eval()
    sparse = CausalLM.from_hf(hf, attn_impl="triton")
    state = {k: v for k, v in hf.state_dict().items() if ".indexer." not in k}
    dense_cfg = sparse.cfg.replace(model_type="deepseek_v3", indexer=None)
    dense = CausalLM.from_state_dict(dense_cfg, state, device="cuda", attn_impl="triton")
    return sparse, dense


def batch(b, ctx, qlen, num_layers, cfg):
    """Random caches (`num_layers` of them) for `b` requests at `ctx` cached tokens, and the metadata of `qlen`
    more tokens each."""
    per = math.ceil((ctx + qlen) / BLOCK)
    spec = KVCacheSpec(num_layers, b * per, BLOCK, 1, ROPE, torch.bfloat16, cfg.kv_entry_shapes)
    cache = PagedKVCache(spec, "cuda")
    for layer in cache.layers:
        for t in layer:
            t.normal_()
    builder = MetadataBuilder(b * qlen, b, per, BLOCK, "cuda")
    tables = torch.arange(b * per).view(b, per).tolist()
    return cache, builder.build([RequestSlice(tbl, ctx, qlen) for tbl in tables])


def graph_ms(fn, repeat=1) -> float:
    fn()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / repeat


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for m in (model.layers, model.norm) for p in m.parameters())


def step_time(model, b, ctx, qlen) -> float:
    """ms of one forward of `model` over a batch of b requests (qlen new tokens after ctx), as one graph."""
    cache, (meta, pos) = batch(b, ctx, qlen, model.cfg.num_layers, model.cfg)
    ids = torch.randint(0, 1024, (b * qlen,), device="cuda")
    with torch.no_grad():
        return graph_ms(lambda: model(ids, pos, meta, cache.layers))


def step_times(sparse, dense, b, ctx, qlen, bw):
    """(name, ms, floor ms) for the sparse and the dense stack."""
    kv = {
        "sparse": b * (qlen * min(TOPK, ctx) * (RANK + ROPE) + ctx * IDX_DIM) * 2,  # picks per row + index keys
        "dense": b * ctx * (RANK + ROPE) * 2,
    }
    rows = []
    for name, model in (("sparse", sparse), ("dense", dense)):
        floor = (weight_bytes(model) + model.cfg.num_layers * kv[name]) / bw * 1e3
        rows.append((name, step_time(model, b, ctx, qlen), floor))
        torch.cuda.empty_cache()
    return rows


def kernel_times(sparse, b, ctx, qlen, bw):
    """Per-layer kernels on `copies` cache copies; each checked once against its reference."""
    per_copy = b * (ctx + qlen) * (RANK + ROPE + IDX_DIM) * 2
    copies = max(1, min(16, COPY_BYTES // per_copy))
    cache, (meta, _) = batch(b, ctx, qlen, copies, sparse.cfg)  # copy c: "layer" c, the same block tables
    t, heads = b * qlen, sparse.cfg.num_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    iq, ik, iw = rnd(t, IDX_HEADS, IDX_DIM), rnd(t, IDX_DIM), rnd(t, IDX_HEADS).float()
    q_lat, q_pe = rnd(t, heads, RANK), rnd(t, heads, ROPE)
    layer = lambda c: cache.layers[c]  # noqa: E731
    no_write = torch.full((t,), -1, dtype=torch.int64, device="cuda")  # the caches stay as they are

    args = (meta.block_tables, meta.token_req, meta.token_kv_len)

    def indexer(c, impl=indexer_topk_triton):
        return impl(iq, ik, iw, layer(c)[2], no_write, *args, IDX_DIM**-0.5, TOPK)

    picks = indexer(0)
    want = indexer(0, indexer_topk_reference)
    same = (picks.sort(1).values == want.sort(1).values).all(1).float().mean().item()
    assert same >= 0.99, f"indexer picks equal the reference's in only {same:.1%} of the rows"
    span = meta.block_tables.shape[1] * BLOCK
    scores = torch.empty(t, span, dtype=torch.float32, device="cuda")
    out = torch.empty_like(picks)

    splits = choose_score_splits(t, span, scores.device)

    def score(c):
        score_rows(iq, iw, layer(c)[2], *args, IDX_DIM**-0.5, TOPK, scores, splits)

    def sparse_attn(c):
        return sparse_mla_latent_triton(q_lat, q_pe, *layer(c)[:2], picks, *args, 0.07)

    def dense_attn(c):
        return mla_latent_triton(q_lat, q_pe, *layer(c)[:2], *args, 0.07)

    lat, rope = layer(0)[:2]
    ref = sparse_mla_latent_reference(q_lat, q_pe, lat, rope, picks, *args[:2], 0.07).float()
    torch.testing.assert_close(sparse_attn(0).float(), ref, atol=2e-2, rtol=2e-2)
    ref = mla_latent_reference(q_lat, q_pe, lat, rope, *args, 0.07).float()
    torch.testing.assert_close(dense_attn(0).float(), ref, atol=2e-2, rtol=2e-2)
    score(0)

    def over_copies(fn):
        state = iter(range(10**9))
        return graph_ms(lambda: fn(next(state) % copies), repeat=copies) * 1e3  # us per launch

    n_sel = min(TOPK, ctx)
    floors = {
        "indexer": b * ctx * IDX_DIM * 2,
        "  score": b * ctx * IDX_DIM * 2,
        "  select": t * ctx * 4 if ctx > TOPK else 0,  # the scores read once (the kernel reads them 5 times)
        "sparse attention": t * n_sel * (RANK + ROPE) * 2,
        "dense attention": b * ctx * (RANK + ROPE) * 2,
    }
    times = {
        "indexer": over_copies(indexer),
        "  score": over_copies(score),
        "  select": over_copies(lambda c: select_rows(scores, meta.token_kv_len, TOPK, out)),
        "sparse attention": over_copies(sparse_attn),
        "dense attention": over_copies(dense_attn),
    }
    return [(name, times[name], floors[name] / bw * 1e6) for name in times], copies


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--qlens", default="1,4", help="query tokens per request (4 = verify at K = 3)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    bw = copy_bandwidth()
    sparse, dense = build_models(args.layers)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers, weights: sparse "
          f"{weight_bytes(sparse) / 1e6:.0f} MB (indexer included), dense {weight_bytes(dense) / 1e6:.0f} MB; "
          f"context {args.context}, top-{TOPK}")  # fmt: skip
    for qlen in ints(args.qlens):
        for b in ints(args.batches):
            print(f"\nbatch {b}, {qlen} query token(s) per request")
            print(f"  {'step (one graph)':<22} {'ms':>8} {'floor ms':>9} {'x floor':>8}")
            for name, ms, floor in step_times(sparse, dense, b, args.context, qlen, bw):
                print(f"  {name:<22} {ms:>8.3f} {floor:>9.3f} {ms / floor:>8.1f}")
            rows, copies = kernel_times(sparse, b, args.context, qlen, bw)
            print(f"  {'kernel (one layer)':<22} {'us':>8} {'floor us':>9} {'x floor':>8}   ({copies} cache copies)")
            for name, us, floor in rows:
                ratio = f"{us / floor:>8.1f}" if floor else f"{'-':>8}"
                print(f"  {name:<22} {us:>8.1f} {floor:>9.1f} {ratio}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
