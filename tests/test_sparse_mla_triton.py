"""DeepSeek Sparse Attention's Triton kernels (ops/sparse_mla/triton_indexer.py, triton_sparse_mla.py) against
the references, under TRITON_INTERPRET=1 on CPU tensors (natively on CUDA where there is one).

Batches: a prefill past the top-k, a chunk plus verify-shaped rows (1+K = 4) and decode rows of other
requests (mixed), decode rows; the last row of each is padding (slot -1, kv_len 0). Rows with fewer visible
keys than topk, exact ties (a zero plateau and duplicated keys) across select blocks, the scoring grid split
1 and 3 ways and the rows chunked through a small scratch; the attention with 1, 2 and 3 splits, -1 entries
inside a row's valid range, two head blocks.

Tolerances: picks are compared as sets (the order inside a row is not part of the contract). Scores are
float32 sums in another order than the reference's, so where the float64 gap between the topk-th and the next
score is under 1e-4 only the threshold property is asserted (no unpicked score above a picked one by more
than 1e-4); elsewhere the sets must be equal. Attention: 1e-5 (float32), 2e-2 (bfloat16).
"""

import pytest
import torch

import draftgraph.ops.sparse_mla.triton_indexer as triton_indexer
import draftgraph.ops.splitting  # noqa: F401  (registers the ops)
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.backends import GraphSupport, family_backend
from draftgraph.ops.mla.reference import mla_latent_reference
from draftgraph.ops.mla.triton_latent import mla_latent_triton
from draftgraph.ops.sparse_mla.op import _kernels
from draftgraph.ops.sparse_mla.reference import (
    indexer_topk_reference,
    sparse_mla_latent_reference,
    sparse_mla_reference,
)
from draftgraph.ops.sparse_mla.triton_indexer import indexer_topk_triton
from draftgraph.ops.sparse_mla.triton_sparse_mla import sparse_mla_latent_triton, sparse_mla_triton
from tests.helpers import PagedRunner
from tests.test_deepseek_v32 import tiny_v32_model
from tests.test_sparse_mla import DIM, HEADS, STEPS, Shape, request_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def runners(n=2, blocks=32):
    return [PagedRunner(Shape, num_blocks=blocks, block_size=4, device=DEVICE) for _ in range(n)]


def padded_batch(runner, parts):
    meta, _ = runner.batch(parts)
    meta.slot_mapping[-1], meta.token_kv_len[-1] = -1, 0  # padding: writes nothing, sees nothing
    return meta


def exact_scores(q, w, keys, n):
    """float64 scores of positions 0..n-1 for one token."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    dots = torch.relu(q.double() @ keys[:n].double().T * DIM**-0.5)  # [Hi, n]
    return w.double() @ dots


def check_picks(got, want, q, w, cache, meta, topk):
    """Per row: min(topk, n) distinct visible positions then -1; the reference's set where it is not within
    rounding of a tie, else the threshold property."""
    for t in range(meta.num_tokens):
        n = int(meta.token_kv_len[t])
        row, keep = got[t].tolist(), min(topk, n)
        assert all(p == -1 for p in row[keep:]), (t, row)
        picked = row[:keep]
        assert len(set(picked)) == keep and all(0 <= p < n for p in picked), (t, row)
        if keep == n:
            continue
        table = meta.block_tables[int(meta.token_req[t])].tolist()
        s = exact_scores(q[t].cpu(), w[t].cpu(), request_keys(cache.cpu(), table, n), n)
        ranked = s.sort(descending=True).values
        if ranked[topk - 1] - ranked[topk] > 1e-4:
            assert set(picked) == {p for p in want[t].tolist() if p >= 0}, (t, row, want[t].tolist())
        unpicked = torch.ones(n, dtype=torch.bool)
        unpicked[picked] = False
        assert s[unpicked].max() <= s[picked].min() + 1e-4, t


@pytest.mark.parametrize("topk,splits,budget", [(5, 1, 1 << 20), (5, 3, 300), (8, 2, 1 << 20), (200, 1, 1 << 20)])
def test_indexer_matches_reference(topk, splits, budget):
    """topk 200 > every visible length (and the 128-position span): every visible position, then -1. Budget
    300 chunks the rows 2 at a time (span 128) through the scratch."""
    gen = torch.Generator().manual_seed(0)
    ref_runner, tri_runner = runners()
    for parts in STEPS:
        ref_meta, meta = padded_batch(ref_runner, parts), padded_batch(tri_runner, parts)
        t = meta.num_tokens
        q, k, w = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((t, HEADS, DIM), (t, DIM), (t, HEADS)))
        ref_cache, cache = ref_runner.cache.layers[0][2], tri_runner.cache.layers[0][2]
        args = (ref_meta.slot_mapping, ref_meta.block_tables, ref_meta.token_req, ref_meta.token_kv_len)
        want = indexer_topk_reference(q, k, w, ref_cache, *args, DIM**-0.5, topk)
        args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len)
        got = indexer_topk_triton(q, k, w, cache, *args, DIM**-0.5, topk, splits=splits, score_budget=budget)
        assert got.shape == (t, topk) and got.dtype == torch.int32
        assert torch.equal(cache, ref_cache)  # the same keys written at the same slots
        assert (got[-1] == -1).all()  # the padding row
        check_picks(got, want, q, w, cache, meta, topk)


@pytest.mark.parametrize("select_block", [16, 2048])
def test_indexer_exact_ties_go_to_the_lower_position(monkeypatch, select_block):
    """Exact ties, equal to the reference entry for entry once sorted: a zero plateau (all head weights <= 0,
    one of them -0.0: every score <= 0, the best exactly -0.0, the rest -15) and, in a second request,
    duplicated keys tied at every level. A select block of 16 spreads the ties over blocks (ranks carried)."""
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK", select_block)
    ref_runner, tri_runner = runners(blocks=24)
    n0, n1 = 20, 30
    k = torch.zeros(n0 + n1, DIM)
    k[:n0, 0] = 1.0
    k[[3, 6, 17], 0] = -1.0  # dot <= 0 for every head: score exactly 0, the best of request 0
    q = torch.zeros(n0 + n1, HEADS, DIM)
    q[:n0, :, 0] = 1.0
    w = torch.ones(n0 + n1, HEADS)
    w[:n0] = -1.0
    w[:n0, 0] = -0.0  # a -0.0 weight: sums of -0.0 and +0.0 terms
    k[n0:, 1] = torch.arange(n1) % 7 * 0.25  # request 1: 7 distinct keys, each repeated: ties at every level
    q[n0:, :, 1] = 1.0
    picks = {}
    for name, runner, fn in (("ref", ref_runner, indexer_topk_reference), ("tri", tri_runner, indexer_topk_triton)):
        meta, _ = runner.batch([(0, n0), (1, n1)])
        args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len)
        picks[name] = [fn(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), runner.cache.layers[0][2], *args, 1.0, topk)
                       for topk in (4, 9)]  # fmt: skip
    for want, got in zip(picks["ref"], picks["tri"]):
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    assert sorted(picks["tri"][0][n0 - 1].tolist()) == [0, 3, 6, 17]  # 3 zeros, then the lowest tie
    # request 1's last token: the 4 keys of 1.5 (positions 6 + 7i), the 4 of 1.25, the lowest of the 1.0s
    assert sorted(picks["tri"][1][-1].tolist()) == [4, 5, 6, 12, 13, 19, 20, 26, 27]


def attention_inputs(t, gen, dtype, heads, nope=8, head_v=8):
    x = dict(q_nope=(t, heads, nope), q_pe=(t, heads, 8), kv_c=(t, 32), k_pe=(t, 8))
    x = {name: torch.randn(*s, generator=gen).to(DEVICE, dtype) for name, s in x.items()}
    x["w_kv_b"] = (torch.randn(heads * (nope + head_v), 32, generator=gen) * 0.2).to(DEVICE, dtype)
    return x


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sparse_mla_matches_reference(dtype, tol):
    """The op end to end with the indexer's picks (valid first, -1 after), some rows with -1 inside the valid
    range, 40 heads (two head blocks, the second partly masked); caches written alike."""
    gen = torch.Generator().manual_seed(1)
    shape = type("TypedShape", (Shape,), {"dtype": dtype})
    ref_runner, tri_runner = (PagedRunner(shape, num_blocks=32, block_size=4, device=DEVICE) for _ in range(2))
    for parts in STEPS:
        ref_meta, meta = padded_batch(ref_runner, parts), padded_batch(tri_runner, parts)
        t = meta.num_tokens
        x = attention_inputs(t, gen, dtype, heads=40)
        picks = torch.stack([torch.randperm(max(n, 6), generator=gen)[:6] for n in meta.token_kv_len.tolist()])
        picks = picks.to(DEVICE).int()
        picks[picks >= meta.token_kv_len[:, None]] = -1
        picks = picks.sort(dim=1, descending=True).values  # valid entries first (the indexer's layout)
        picks[1, 0] = -1  # a hole inside the valid range: skipped
        lat, rope, _ = ref_runner.cache.layers[0]
        args = (ref_meta.slot_mapping, ref_meta.block_tables, ref_meta.token_req, ref_meta.token_kv_len, 0.3)
        want = sparse_mla_reference(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], lat, rope, x["w_kv_b"], picks, *args)
        tlat, trope, _ = tri_runner.cache.layers[0]
        args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len, 0.3)
        got = sparse_mla_triton(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], tlat, trope, x["w_kv_b"], picks, *args)
        assert got.shape == want.shape and got.dtype == dtype and not got[-1].any()  # padding row: zeros
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(tlat, lat) and torch.equal(trope, rope)


def test_sparse_mla_splits_merge_to_the_reference():
    """Picks split 1, 2 and 3 ways over 64-entry tiles: a verify-shaped request (4 rows, 150 + j visible, 140
    picks with -1 holes, one tile of holes only), a short decode row and the padding row; float32."""
    gen = torch.Generator().manual_seed(3)
    runner = PagedRunner(Shape, num_blocks=16, block_size=16, device=DEVICE)
    lat, rope, _ = runner.cache.layers[0]
    lat.copy_(torch.randn(lat.shape, generator=gen))
    rope.copy_(torch.randn(rope.shape, generator=gen))
    runner.batch([(0, 150), (1, 3)])  # positions cached (the caches hold random rows already)
    meta = padded_batch(runner, [(0, 4), (1, 1), (2, 1)])
    t, topk = meta.num_tokens, 200
    picks = torch.full((t, topk), -1, dtype=torch.int32)
    for i, n in enumerate(meta.token_kv_len.tolist()):
        picks[i, : min(140, n)] = torch.randperm(n, generator=gen)[: min(140, n)].int()
    picks[0, 64:128] = -1  # a whole tile of holes: its split sees nothing
    picks[1, 5:9] = -1
    picks = picks.to(DEVICE)
    q_lat = torch.randn(t, 4, 32, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, 4, 8, generator=gen).to(DEVICE)
    args = (meta.block_tables, meta.token_req)
    want = sparse_mla_latent_reference(q_lat, q_pe, lat, rope, picks, *args, 0.3)
    for splits in (1, 2, 3):
        got = sparse_mla_latent_triton(q_lat, q_pe, lat, rope, picks, *args, meta.token_kv_len, 0.3, num_splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not got[-1].any()


def test_dense_mla_splits_merge_to_the_reference():
    """Dense MLA runs the same split kernel over every visible position (ops/mla/triton_latent.py): split 1,
    2, 3 and the rule's own choice, a verify-shaped request (4 rows, 151-154 visible), a decode row of 4 and
    the padding row, against mla_latent_reference; float32."""
    gen = torch.Generator().manual_seed(4)
    runner = PagedRunner(Shape, num_blocks=16, block_size=16, device=DEVICE)
    lat, rope, _ = runner.cache.layers[0]
    lat.copy_(torch.randn(lat.shape, generator=gen))
    rope.copy_(torch.randn(rope.shape, generator=gen))
    runner.batch([(0, 150), (1, 3)])
    meta = padded_batch(runner, [(0, 4), (1, 1), (2, 1)])
    t = meta.num_tokens
    q_lat = torch.randn(t, 4, 32, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, 4, 8, generator=gen).to(DEVICE)
    args = (meta.block_tables, meta.token_req, meta.token_kv_len, 0.3)
    want = mla_latent_reference(q_lat, q_pe, lat, rope, *args)
    for splits in (1, 2, 3, None):
        got = mla_latent_triton(q_lat, q_pe, lat, rope, *args, num_splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not got[-1].any()  # the padding row


def test_triton_is_the_kernels_and_graph_safe():
    """The "triton" name runs the kernels and declares FULL graphs for any batch, on CUDA; others the reference."""
    assert _kernels("triton") == (indexer_topk_triton, sparse_mla_triton)
    assert _kernels("sdpa") == (indexer_topk_reference, sparse_mla_reference)
    backend = family_backend("sparse_mla", "triton")
    assert backend.graph_support == GraphSupport.ALWAYS and backend.devices == ("cuda",)


def test_model_logits_match_transformers_with_the_kernels():
    """The tiny V3.2 model (top-8 of up to 16 positions, 16 indexer heads) with attn_impl="triton": a 10-token
    prefill, a verify-shaped 4-token chunk, then 2 decode steps (one row each, past the top-8: the decode path;
    more steps would repeat it), logits equal transformers' (1e-4)."""
    hf = tiny_v32_model().to(DEVICE)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    target = CausalLM.from_hf(hf, attn_impl="triton")
    runner = PagedRunner(target.cfg, block_size=4, device=DEVICE)
    got, start = [], 0
    with torch.no_grad():
        for n in (10, 4, 1, 1):
            meta, pos = runner.batch([(0, n)])
            hidden = target(ids[0, start : start + n], pos, meta, runner.cache.layers)[0]
            got.append(target.compute_logits(hidden))
            start += n
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)
