"""Paged attention: the reference against a dense per-request oracle, then SDPA and Triton against the reference.

On a CPU machine the Triton kernels run under TRITON_INTERPRET=1 (conftest.py); on the GPU machine the
same file runs them on CUDA (python -m pytest tests/test_attention.py). Tolerances: float32 1e-5
(ieee dot products on both sides), bf16 2e-2 (bf16 operands, float32 accumulation).
"""

import math

import pytest
import torch

import draftgraph.ops.splitting  # noqa: F401  (registers the attention ops)
from draftgraph.ops.backends import GraphSupport, check_device, require_graph_support
from tests.helpers import PagedRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Shape:
    def __init__(self, heads, kv_heads, head_dim, block_size, dtype=torch.float32):
        self.heads, self.kv_heads, self.head_dim, self.block_size, self.dtype = (
            heads,
            kv_heads,
            head_dim,
            block_size,
            dtype,
        )
        self.num_kv_heads, self.num_layers = kv_heads, 1


def run_steps(shape, steps, impl, seed=0, window=0):
    """steps: list of batches [(request id, new tokens)]. Returns outputs per step and the final cache."""
    gen = torch.Generator().manual_seed(seed)
    runner = PagedRunner(shape, num_blocks=128, block_size=shape.block_size, device=DEVICE)
    k_cache, v_cache = runner.cache.layers[0]
    outs = []
    for parts in steps:
        meta, _ = runner.batch(parts)
        t = meta.num_tokens
        q, k, v = (
            torch.randn(t, h, shape.head_dim, generator=gen).to(DEVICE, shape.dtype)
            for h in (shape.heads, shape.kv_heads, shape.kv_heads)
        )
        outs.append(
            torch.ops.draftgraph.paged_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.token_req,
                meta.token_kv_len,
                1 / math.sqrt(shape.head_dim),
                window,
                impl,
            )
        )
    return outs, (k_cache, v_cache)


def dense_oracle(shape, steps, seed=0, window=0):
    """Each request's full K/V kept densely; plain softmax attention with an explicit causal mask."""
    gen = torch.Generator().manual_seed(seed)
    history: dict[int, tuple[list, list]] = {}
    outs = []
    group = shape.heads // shape.kv_heads
    for parts in steps:
        t = sum(n for _, n in parts)
        q, k, v = (
            torch.randn(t, h, shape.head_dim, generator=gen).to(shape.dtype).double()
            for h in (shape.heads, shape.kv_heads, shape.kv_heads)
        )
        out = torch.empty(t, shape.heads, shape.head_dim, dtype=torch.float64)
        row = 0
        for rid, n in parts:
            ks, vs = history.setdefault(rid, ([], []))
            ks.append(k[row : row + n])
            vs.append(v[row : row + n])
            kk = torch.cat(ks).repeat_interleave(group, dim=1)  # [S, Hq, D]
            vv = torch.cat(vs).repeat_interleave(group, dim=1)
            s_len = kk.shape[0]
            scores = torch.einsum("qhd,shd->hqs", q[row : row + n], kk) / math.sqrt(shape.head_dim)
            qpos = torch.arange(s_len - n, s_len)[:, None]
            kpos = torch.arange(s_len)[None, :]
            mask = kpos <= qpos
            if window:
                mask &= kpos > qpos - window
            scores = scores.masked_fill(~mask, float("-inf"))
            out[row : row + n] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vv)
            row += n
        outs.append(out)
    return outs


# Each case is a sequence of batches; request ids persist across steps (their KV stays cached).
CASES = {
    "prefill-cross-blocks": [[(0, 13), (1, 5)]],
    "length-1": [[(0, 1)], [(0, 1)], [(1, 1), (0, 1)]],
    "chunked-prefill": [[(0, 6)], [(0, 7)], [(0, 5)]],
    "decode": [[(0, 9), (1, 3)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]],
    "verify-1+K": [[(0, 10), (1, 4)], [(0, 4), (1, 4)]],
    "mixed": [[(0, 11)], [(0, 1), (1, 9), (2, 4)], [(2, 1), (0, 4), (1, 1)]],
}
# Runs longer than sdpa.SHORT_RUN rows take SDPA's per-request path: a whole prefill (is_causal), chunks
# after a cached prefix (a visibility mask), decode rows batched beside them.
LONG_CASES = {
    "long-prefill-chunks": [[(0, 40), (1, 20)], [(0, 24), (1, 1)], [(1, 18), (0, 1)]],
}
SHAPES = {
    "gqa4-d64-bs4": Shape(8, 2, 64, 4),
    "mha-d128-bs16": Shape(2, 2, 128, 16),
    "gqa2-d256-bs1": Shape(4, 2, 256, 1),
    "gqa8-d64-bs32": Shape(8, 1, 64, 32),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_matches_dense_oracle(case, shape):
    got, _ = run_steps(SHAPES[shape], CASES[case], "reference")
    want = dense_oracle(SHAPES[shape], CASES[case])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_matches_reference(case, shape):
    ref, ref_cache = run_steps(SHAPES[shape], CASES[case], "reference")
    got, got_cache = run_steps(SHAPES[shape], CASES[case], "triton")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)
    assert torch.equal(got_cache[0], ref_cache[0]) and torch.equal(got_cache[1], ref_cache[1])


@pytest.mark.parametrize("case", list(CASES) + list(LONG_CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sdpa_matches_reference(case, shape):
    steps = {**CASES, **LONG_CASES}[case]
    ref, ref_cache = run_steps(SHAPES[shape], steps, "reference")
    got, got_cache = run_steps(SHAPES[shape], steps, "sdpa")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)
    assert torch.equal(got_cache[0], ref_cache[0]) and torch.equal(got_cache[1], ref_cache[1])


@pytest.mark.parametrize("window", [5, 17, 64])  # inside a block, across blocks, past every key (no window)
def test_sdpa_sliding_window_long_runs(window):
    shape = SHAPES["gqa4-d64-bs4"]
    steps = LONG_CASES["long-prefill-chunks"]
    got, _ = run_steps(shape, steps, "sdpa", window=window)
    for g, w in zip(got, dense_oracle(shape, steps, window=window)):
        torch.testing.assert_close(g.double().cpu(), w, atol=1e-5, rtol=0)


def test_sdpa_chunks_through_a_mask_where_cpu_flash_is_absent(monkeypatch):
    """Other devices (and a torch without the CPU flash op) run chunks after a prefix through a mask."""
    import draftgraph.ops.attention.sdpa as sdpa

    monkeypatch.setattr(sdpa, "_CPU_FLASH", None)
    shape = SHAPES["gqa4-d64-bs4"]
    ref, _ = run_steps(shape, LONG_CASES["long-prefill-chunks"], "reference")
    got, _ = run_steps(shape, LONG_CASES["long-prefill-chunks"], "sdpa")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


def test_sdpa_bf16_against_reference():
    shape = Shape(8, 2, 128, 16, torch.bfloat16)
    steps = CASES["mixed"] + LONG_CASES["long-prefill-chunks"]
    got, _ = run_steps(shape, steps, "sdpa")
    ref, _ = run_steps(shape, steps, "reference")
    for g, r in zip(got, ref):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "sdpa", "triton"])
def test_sliding_window(impl):
    shape = SHAPES["gqa4-d64-bs4"]
    steps = CASES["mixed"]
    got, _ = run_steps(shape, steps, impl, window=5)
    for g, w in zip(got, dense_oracle(shape, steps, window=5)):
        torch.testing.assert_close(g.double().cpu(), w, atol=1e-5, rtol=0)


def test_triton_bf16_against_reference():
    shape = Shape(8, 2, 128, 16, torch.bfloat16)
    got, _ = run_steps(shape, CASES["mixed"], "triton")
    ref, _ = run_steps(shape, CASES["mixed"], "reference")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "sdpa", "triton"])
def test_padding_rows_write_nothing_and_read_nothing(impl):
    shape = SHAPES["gqa4-d64-bs4"]
    runner = PagedRunner(shape, num_blocks=16, block_size=4, device=DEVICE)
    k_cache, v_cache = runner.cache.layers[0]
    slices = []
    for rid, n in ((0, 3), (1, 2)):
        from draftgraph.runtime.kv_cache import BlockTable

        runner.tables[rid] = BlockTable(runner.alloc, 4)
        runner.tables[rid].ensure_capacity(n)
        from draftgraph.runtime.attn_metadata import RequestSlice

        slices.append(RequestSlice(runner.tables[rid].blocks, 0, n))
    meta, pos = runner.builder.build(slices, num_tokens_padded=8, num_reqs_padded=4)
    assert meta.slot_mapping[5:].eq(-1).all() and meta.token_kv_len[5:].eq(0).all()
    q = torch.randn(8, 8, 64, device=DEVICE)
    k = torch.randn(8, 2, 64, device=DEVICE)
    out = torch.ops.draftgraph.paged_attention(
        q,
        k,
        k.clone(),
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.block_tables,
        meta.token_req,
        meta.token_kv_len,
        0.125,
        0,
        impl,
    )
    assert out[5:].eq(0).all()
    written = k_cache.view(-1, 2, 64).abs().sum((1, 2)).ne(0).sum().item()
    assert written == 5  # only the 5 real tokens reached the cache


def test_backend_declarations_and_errors():
    with pytest.raises(ValueError, match="'flash'.*choose one of"):
        check_device("flash", "cpu")
    with pytest.raises(ValueError, match="reference.*NEVER.*UNIFORM_BATCH"):
        require_graph_support("reference", GraphSupport.UNIFORM_BATCH, "a FULL verify graph")
    require_graph_support("triton", GraphSupport.ALWAYS, "a FULL mixed graph")
