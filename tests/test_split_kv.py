"""Split-KV (flash-decoding) paged attention against the PyTorch reference, the unsplit kernel, and its rule.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (conftest.py; sizes kept tiny so the file takes
seconds); on the GPU machine the same file runs them natively, plus a CUDA-graph replay with new lengths.
Tolerances: float32 1e-5 (ieee dots; only the summation order differs), bf16 2e-2.
"""

import math

import pytest
import torch

import draftgraph.ops.attention.triton_attention as ta
import draftgraph.ops.attention.triton_split_kv as sk
from draftgraph.ops.attention.reference import paged_attention_reference
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16  # GQA group 2, block size 16

# (keys cached before the step, query tokens) per request. Decode: lengths around the 64-key tile and the
# 16-key block; verify: query lengths 1..5 (K = 0..4 drafts) over ragged contexts.
CASES = {
    "decode": ([0, 15, 16, 63, 64, 129, 300], [1] * 7),
    "verify": ([3, 60, 70, 130, 140], [1, 2, 3, 4, 5]),
}
PAD_ROWS = 2  # graph padding: token_kv_len 0, slot -1


def make_batch(ctxs, qlens, dtype=torch.float32, seed=0):
    """Random caches and q; metadata for the requests (blocks shuffled so tables are not consecutive)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((c + n) / BLOCK) for c, n in zip(ctxs, qlens)]
    order = torch.randperm(sum(need), generator=gen).tolist()
    k_cache, v_cache = (torch.randn(sum(need), BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    num_tokens = sum(qlens) + PAD_ROWS
    builder = MetadataBuilder(num_tokens, len(ctxs), max(need), BLOCK, DEVICE)
    starts = [sum(need[:i]) for i in range(len(need))]
    reqs = [RequestSlice(order[s : s + b], c, n) for s, b, c, n in zip(starts, need, ctxs, qlens)]
    meta, _ = builder.build(reqs, num_tokens_padded=num_tokens)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    return q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), meta


def reference(q, k_cache, v_cache, meta, window=0):
    no_write = torch.full_like(meta.slot_mapping, -1)
    kv = q.new_zeros(q.shape[0], KV_HEADS, HEAD_DIM)
    args = (no_write, meta.block_tables, meta.token_req, meta.token_kv_len, HEAD_DIM**-0.5, window)
    return paged_attention_reference(q, kv, kv, k_cache, v_cache, *args)


def attend(q, k_cache, v_cache, meta, num_splits, window=0):
    args = (meta.block_tables, meta.token_req, meta.token_kv_len, HEAD_DIM**-0.5, window)
    return ta.attend_triton(q, k_cache, v_cache, *args, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_split_kv_matches_reference_and_unsplit_kernel(case, num_splits):
    q, k_cache, v_cache, meta = make_batch(*CASES[case])
    got = sk.attend_split_kv(q, k_cache, v_cache, meta.block_tables, meta.token_req, meta.token_kv_len,
                             HEAD_DIM**-0.5, 0, num_splits)  # fmt: skip
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta), atol=1e-5, rtol=0)
    assert got[-PAD_ROWS:].eq(0).all()  # padding rows (kv_len 0): zeros, as the unsplit kernel gives
    if num_splits == 4:  # once per case (the interpreter is slow): the unsplit kernel agrees with it
        unsplit = attend(q, k_cache, v_cache, meta, num_splits=1)
        torch.testing.assert_close(got, unsplit, atol=1e-5, rtol=0)
        assert unsplit[-PAD_ROWS:].eq(0).all()


@pytest.mark.parametrize("window", [5, 37])  # inside a block; across tiles and splits
def test_split_kv_sliding_window(window):
    q, k_cache, v_cache, meta = make_batch(*CASES["verify"])
    got = attend(q, k_cache, v_cache, meta, num_splits=4, window=window)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta, window), atol=1e-5, rtol=0)


def test_split_kv_bf16():
    q, k_cache, v_cache, meta = make_batch(*CASES["decode"], dtype=torch.bfloat16)
    got = attend(q, k_cache, v_cache, meta, num_splits=4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k_cache, v_cache, meta).float(), atol=2e-2, rtol=0)


def test_op_dispatches_to_split_kv_by_the_rule(monkeypatch):
    """Through torch.ops.draftgraph.paged_attention: the rule (given an SM count and a low context bar)
    picks S > 1, the split kernel runs, the output equals the reference and the KV write is unchanged."""
    import draftgraph.ops.splitting  # noqa: F401  (registers the attention ops)

    calls = []
    real = ta.attend_split_kv
    monkeypatch.setattr(ta, "device_sm_count", lambda device: 64)
    monkeypatch.setattr(sk, "DEFAULT_SPLIT_KV_RULE", sk.SplitKVRule(min_context=64, min_keys_per_split=32))
    monkeypatch.setattr(ta, "attend_split_kv", lambda *a: calls.append(a[-1]) or real(*a))
    q, k_cache, v_cache, meta = make_batch([300, 64, 0], [1, 1, 1])  # 5 rows (2 padding) * 2 KV heads
    k, v = torch.randn(2, q.shape[0], KV_HEADS, HEAD_DIM, device=DEVICE)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len, HEAD_DIM**-0.5, 0)
    want = paged_attention_reference(q, k, v, *caches[0], *args)
    got = torch.ops.draftgraph.paged_attention(q, k, v, *caches[1], *args, "triton")
    # 10 programs < 64 SMs: want ceil(2 * 64 / 10) = 13 splits, at most 19 blocks * 16 keys / 32 = 9 -> 8
    assert calls == [8]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_rule_from_host_known_sizes():
    h100 = 132
    # batch-1 decode, Llama-1B (8 KV heads), 8k context: 8 programs -> ceil(4 * 132 / 8) = 66, capped at 64
    assert sk.choose_num_splits(1, 8, 8192, h100) == 64
    assert sk.choose_num_splits(8, 8, 8192, h100) == 8  # 64 programs -> want 9 -> nearest power of two: 8
    assert sk.choose_num_splits(5, 8, 8192, h100) == 16  # batch-1 verify: 40 programs -> want 14 -> 16
    assert sk.choose_num_splits(40, 8, 8192, h100) == 2  # batch-8 verify: 320 programs -> want 2
    assert sk.choose_num_splits(80, 8, 8192, h100) == 1  # 640 programs fill the GPU
    assert sk.choose_num_splits(1, 8, 512, h100) == 16  # at least 32 keys per split: 512 / 32
    assert sk.choose_num_splits(1, 8, 128, h100) == 1  # short contexts never split
    assert sk.choose_num_splits(1, 8, 8192, None) == 1  # no SM count (CPU, interpreter): never split
    assert sk.choose_num_splits(0, 8, 8192, h100) == 1
    for t in range(1, 20):
        s = sk.choose_num_splits(t, 8, 32768, h100)
        assert s & (s - 1) == 0 and s <= sk.DEFAULT_SPLIT_KV_RULE.max_splits
    assert sk.choose_num_splits(1, 8, 8192, h100, sk.SplitKVRule(max_splits=8)) == 8
    with pytest.raises(ValueError, match="max_programs_per_sm.*target_programs_per_sm"):
        sk.SplitKVRule(max_programs_per_sm=5.0)
    with pytest.raises(ValueError, match="max_splits = 0 must be >= 1"):
        sk.SplitKVRule(max_splits=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_split_kv_replays_in_a_cuda_graph_with_new_lengths():
    """The grid is fixed by T and S only: a captured launch reads the lengths written into the same buffers."""
    q, k_cache, v_cache, meta = make_batch(*CASES["decode"])
    attend(q, k_cache, v_cache, meta, num_splits=8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, k_cache, v_cache, meta, num_splits=8)
    meta.token_kv_len[:-PAD_ROWS].copy_(torch.tensor([1, 2, 30, 64, 17, 100, 5], device=DEVICE))
    graph.replay()
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, meta), atol=1e-5, rtol=0)


def test_split_kernels_compile_for_a_hopper_gpu():
    """Both kernels, and the unsplit one (triton_attention.py), through Triton's sm_90 backend on this machine (no
    GPU needed; tests/helpers.py); with programmatic dependent launch (ops/triton_pdl.py) each waits before its
    first load."""
    from draftgraph.ops.attention.triton_attention import _paged_attention_kernel
    from tests.helpers import assert_pdl_order, compile_many_for_sm90

    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "acc_ptr": "*fp32", "m_ptr": "*fp32",
           "l_ptr": "*fp32", "block_tables_ptr": "*i32", "token_req_ptr": "*i32", "token_kv_len_ptr": "*i32",
           "scale": "fp32", "window": "i32", "NUM_SPLITS": "i32", "num_heads": "i32"}  # fmt: skip
    sig.update({n: "i64" for n in ("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt")})
    constexprs = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "D_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
                  "PRECISION": "tf32", "DOT_F32": False}  # fmt: skip
    merge_sig = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16",
                 "token_kv_len_ptr": "*i32", "stride_ot": "i64", "stride_oh": "i64", "window": "i32",
                 "NUM_SPLITS": "i32", "num_heads": "i32"}  # fmt: skip
    merge = {"HEAD_DIM": 128, "D_PAD": 128, "S_PAD": 16, "BLOCK_N": 64}
    unsplit_sig = {k: v for k, v in sig.items() if k not in ("acc_ptr", "m_ptr", "l_ptr", "NUM_SPLITS", "num_heads")}
    unsplit_sig.update({"out_ptr": "*bf16", "stride_ot": "i64", "stride_oh": "i64"})
    jobs, levels = [], []
    for level in (0, 3):
        jobs += [(sk._split_kv_kernel, sig, {**constexprs, "PDL": level}),
                 (sk._merge_kernel, merge_sig, {**merge, "PDL": level}),
                 (_paged_attention_kernel, unsplit_sig, {**constexprs, "PDL": level})]  # fmt: skip
        levels += [level] * 3
    for level, got in zip(levels, compile_many_for_sm90(jobs)):  # one process for all (its start costs the most)
        assert "cubin" in got.stages()
        assert_pdl_order(got.ptx, level)
