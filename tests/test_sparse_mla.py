"""DeepSeek Sparse Attention's ops (ops/sparse_mla/): the references against brute-force formulas written
here token by token, the -1 padding and tie rules of the contract, sparse = dense MLA when every visible
token is picked, and no host read (the references run on fake tensors, which refuse one).

Tolerances: 1e-5 in float32 (summation order only).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import draftgraph.ops.splitting  # noqa: F401  (registers the ops)
from draftgraph.ops.sparse_mla.reference import indexer_topk_reference, sparse_mla_reference
from draftgraph.ops.splitting import SPLITTING_OPS
from tests.helpers import PagedRunner

HEADS, DIM = 16, 16  # indexer heads and head dim; 16 heads: exact score ties ~never (see test_deepseek_v32.py)


class Shape:
    """A one-layer cache of MLA latent [32], RoPE key [8] and index key [DIM] per token."""

    num_layers, num_kv_heads, head_dim, dtype = 1, 1, 8, torch.float32
    kv_entry_shapes = ((32,), (8,), (DIM,))


# A prefill past the top-k, a chunk plus verify-shaped rows (1+K = 4) and decode rows; the last row padding.
STEPS = [[(0, 13), (1, 3)], [(0, 4), (1, 4), (2, 9)], [(0, 1), (1, 4), (2, 1)]]


def brute_topk(q, w, keys, kv_len, topk, scale):
    """One token: every visible position's score by the formula, then the top `topk` (lower position on ties)."""
    scores = [
        sum(float(w[h]) * max(0.0, float(q[h] @ keys[p]) * scale) for h in range(q.shape[0])) for p in range(kv_len)
    ]
    order = sorted(range(kv_len), key=lambda p: (-scores[p], p))[:topk]
    return order + [-1] * (topk - len(order))


def request_keys(cache, table, n):
    """Positions 0..n-1 of a request (its block table) read from a [blocks, block_size, ...] cache."""
    bs = cache.shape[1]
    return torch.stack([cache[table[p // bs], p % bs] for p in range(n)]) if n else cache.new_zeros(0, *cache.shape[2:])


def run_steps(topk, fn, gen):
    runner = PagedRunner(Shape, num_blocks=32, block_size=4)
    _, _, index_cache = runner.cache.layers[0]
    for parts in STEPS:
        meta, _ = runner.batch(parts)
        meta.slot_mapping[-1], meta.token_kv_len[-1] = -1, 0  # padding: writes nothing, sees nothing
        t = meta.num_tokens
        q, k = torch.randn(t, HEADS, DIM, generator=gen), torch.randn(t, DIM, generator=gen)
        w = torch.randn(t, HEADS, generator=gen)
        got = indexer_topk_reference(q, k, w, index_cache, meta.slot_mapping, meta.block_tables, meta.token_req,
                                     meta.token_kv_len, DIM**-0.5, topk)  # fmt: skip
        fn(runner, meta, q, k, w, got, index_cache)


@pytest.mark.parametrize("topk", [1, 5, 8, 200])
def test_indexer_matches_brute_force(topk):
    """Every row equals the formula's top-k (as a set: the order inside is not part of the contract, but the
    reference's is by score), -1 past min(topk, visible), padding rows all -1; topk 200 > the block-table span
    (32 blocks x 4) pads the tail. The cache holds each step's keys at their slots."""

    def check(runner, meta, q, k, w, got, index_cache):
        assert got.shape == (meta.num_tokens, topk) and got.dtype == torch.int32
        for t in range(meta.num_tokens - 1):
            table = meta.block_tables[int(meta.token_req[t])].tolist()
            n = int(meta.token_kv_len[t])
            want = brute_topk(q[t], w[t], request_keys(index_cache, table, n), n, topk, DIM**-0.5)
            assert got[t].tolist() == want, t
        assert (got[-1] == -1).all()
        for t in range(meta.num_tokens - 1):
            assert torch.equal(index_cache.view(-1, DIM)[meta.slot_mapping[t]], k[t])

    run_steps(topk, check, torch.Generator().manual_seed(0))


def test_indexer_ties_go_to_the_lower_position():
    """All head weights negative -> every score <= 0 and most exactly 0.0 (ReLU): the plateau's lowest
    positions fill the top-k, after the strictly better (zero-dot) ones."""
    runner = PagedRunner(Shape, num_blocks=8, block_size=4)
    _, _, index_cache = runner.cache.layers[0]
    meta, _ = runner.batch([(0, 10)])
    k = torch.zeros(10, DIM)
    k[:, 0] = 1.0
    k[[3, 6], 0] = -1.0  # these two dot to <= 0 for every head: score exactly 0, the best possible
    q = torch.zeros(10, HEADS, DIM)
    q[:, :, 0] = 1.0
    w = -torch.ones(10, HEADS)
    got = indexer_topk_reference(q, k, w, index_cache, meta.slot_mapping, meta.block_tables, meta.token_req,
                                 meta.token_kv_len, 1.0, 4)  # fmt: skip
    assert got[9].tolist() == [3, 6, 0, 1]  # 3 and 6 score 0 > -16; then ties: lowest positions first
    assert got[2].tolist() == [0, 1, 2, -1]  # 3 visible, all tied
    assert got[4].tolist() == [3, 0, 1, 2]


def mla_inputs(t, gen, heads=4, nope=8, head_v=8):
    return dict(
        q_nope=torch.randn(t, heads, nope, generator=gen),
        q_pe=torch.randn(t, heads, 8, generator=gen),
        kv_c=torch.randn(t, 32, generator=gen),
        k_pe=torch.randn(t, 8, generator=gen),
        w_kv_b=torch.randn(heads * (nope + head_v), 32, generator=gen) * 0.2,
    )


def test_sparse_mla_matches_brute_force():
    """Per token and head: softmax over the picked positions of the decompressed keys (c W_UK, pe) and values
    c W_UV, written out token by token; -1 entries anywhere in a row are skipped; no pick -> zeros."""
    gen = torch.Generator().manual_seed(1)
    runner = PagedRunner(Shape, num_blocks=32, block_size=4)
    latent, rope, _ = runner.cache.layers[0]
    for parts in STEPS:
        meta, _ = runner.batch(parts)
        meta.slot_mapping[-1], meta.token_kv_len[-1] = -1, 0
        t, x = meta.num_tokens, mla_inputs(meta.num_tokens, gen)
        picks = torch.stack([torch.randperm(max(5, int(n)), generator=gen)[:5] for n in meta.token_kv_len])
        picks = torch.cat([picks, -torch.ones(t, 5, dtype=torch.long)], 1)[:, torch.randperm(10, generator=gen)]
        picks[picks >= meta.token_kv_len[:, None].long()] = -1
        picks[-1] = -1
        got = sparse_mla_reference(**x, latent_cache=latent, rope_cache=rope, topk_indices=picks.int(),
                                   slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                                   token_req=meta.token_req, token_kv_len=meta.token_kv_len, scale=0.3)  # fmt: skip
        w = x["w_kv_b"].view(4, 16, 32)
        for i in range(t):
            table = meta.block_tables[int(meta.token_req[i])].tolist()
            sel = [p for p in picks[i].tolist() if p >= 0]
            c, pe = request_keys(latent, table, 64)[sel], request_keys(rope, table, 64)[sel]
            for h in range(4):
                if not sel:
                    assert not got[i, h].any()
                    continue
                s = (c @ w[h, :8].T @ x["q_nope"][i, h] + pe @ x["q_pe"][i, h]) * 0.3
                want = torch.softmax(s, 0) @ (c @ w[h, 8:].T)
                torch.testing.assert_close(got[i, h], want, atol=1e-5, rtol=1e-5)


def test_sparse_equals_dense_mla_when_every_visible_token_is_picked():
    """topk >= every visible length: the indexer picks all of them and sparse MLA is dense MLA (the
    existing op, absorbed form)."""
    gen = torch.Generator().manual_seed(2)
    runners = [PagedRunner(Shape, num_blocks=32, block_size=4) for _ in range(2)]
    for parts in STEPS:
        metas = [r.batch(parts)[0] for r in runners]
        meta = metas[0]
        t, x = meta.num_tokens, mla_inputs(meta.num_tokens, gen)
        q, k, w = (
            torch.randn(t, HEADS, DIM, generator=gen),
            torch.randn(t, DIM, generator=gen),
            torch.randn(t, HEADS, generator=gen),
        )
        latent, rope, index_cache = runners[0].cache.layers[0]
        picks = torch.ops.draftgraph.indexer_topk(q, k, w, index_cache, meta.slot_mapping, meta.block_tables,
                                                  meta.token_req, meta.token_kv_len, 0.25, 64, "reference")  # fmt: skip
        assert ((picks >= 0).sum(1) == meta.token_kv_len).all()
        args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len, 0.3)
        sparse = torch.ops.draftgraph.sparse_mla_attention(
            x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent, rope, x["w_kv_b"], picks, *args, "reference"
        )  # fmt: skip
        latent2, rope2, _ = runners[1].cache.layers[0]
        m2 = metas[1]
        dense = torch.ops.draftgraph.mla_attention(
            x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent2, rope2, x["w_kv_b"], m2.slot_mapping,
            m2.block_tables, m2.token_req, m2.token_kv_len, 0.3, "absorbed", "reference",
        )  # fmt: skip
        torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


def test_references_read_nothing_back_to_the_host():
    """On fake tensors (no data) both references run: no .item(), no data-dependent shape, so they can be
    captured in FULL graphs. Output shapes come from T, topk and the head counts only."""
    with FakeTensorMode():
        t, cache = 7, torch.empty(16, 4, DIM)
        i32 = dict(dtype=torch.int32)
        meta = dict(slot_mapping=torch.empty(t, dtype=torch.int64), block_tables=torch.empty(3, 4, **i32),
                    token_req=torch.empty(t, **i32), token_kv_len=torch.empty(t, **i32))  # fmt: skip
        picks = indexer_topk_reference(torch.empty(t, HEADS, DIM), torch.empty(t, DIM), torch.empty(t, HEADS), cache,
                                       *meta.values(), 0.25, 32)  # fmt: skip
        out = sparse_mla_reference(
            torch.empty(t, 4, 8), torch.empty(t, 4, 8), torch.empty(t, 32), torch.empty(t, 8),
            torch.empty(16, 4, 32), torch.empty(16, 4, 8), torch.empty(64, 32), picks, *meta.values(), 0.3,
        )  # fmt: skip
    assert picks.shape == (t, 32) and out.shape == (t, 4, 8)


def test_only_the_attention_splits():
    assert "draftgraph::sparse_mla_attention" in SPLITTING_OPS
    assert "draftgraph::indexer_topk" not in SPLITTING_OPS  # it stays inside the piece (sparse_mla/op.py)
