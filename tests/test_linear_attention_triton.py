"""The gated_delta_net Triton kernels (TRITON_INTERPRET=1 on CPU tensors, set by conftest.py) against the
PyTorch reference on the same inputs and state rings: decode and verify of 1 + K tokens at different ring
offsets (every ring entry compared, so every per-position state), padding requests, padding tokens and
draft-loop padding rows, long runs token by token, and the chunked path's plumbing (plan, head, final state
at the right ring entry, tail) with the reference's chunked rule standing in for fla (fla itself runs only
on the GPU: tests/gpu/test_qwen3_5_cuda.py). On a CUDA machine the same tests run the kernels natively.
Tolerance: 2e-5 (float32 in a different order)."""

import pytest
import torch

import draftgraph.ops.linear_attention.op  # noqa: F401  (registers torch.ops.draftgraph.gated_delta_net)
from draftgraph.ops.backends import check_linear_attention, linear_attention_impl
from draftgraph.ops.linear_attention import chunked
from draftgraph.ops.linear_attention.reference import chunk_gated_delta_rule, gated_delta_net_reference, l2norm
from draftgraph.ops.linear_attention.triton_gdn import gated_delta_net_triton

HK, HV, DK, DV, W = 2, 4, 12, 6, 4  # head dims off powers of two: the kernels' masks
C = 2 * HK * DK + HV * DV
K = 3
RING, ROWS = K + 1, 6  # a target's ring; rows 0..4 for requests, row 5 scratch
TOL = dict(atol=2e-5, rtol=2e-5)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def batch(runs, num_tokens, draft_rows=False):
    """Metadata of runs [(first position, length)] padded to num_tokens; a length-0 run is a padding
    request. draft_rows: one token per run (query_start_loc = arange), (p0, 0) marking a padding row."""
    qsl, req, kv_len = [0], [], []
    for r, (p0, n) in enumerate(runs):
        if draft_rows:
            qsl.append(r + 1)
            req.append(r)
            kv_len.append(p0 + 1 if n else 0)
            continue
        qsl.append(qsl[-1] + n)
        req += [r] * n
        kv_len += list(range(p0 + 1, p0 + n + 1))
    pad = num_tokens - len(req)
    i32 = dict(dtype=torch.int32, device=DEV)
    return torch.tensor(qsl, **i32), torch.tensor(req + [0] * pad, **i32), torch.tensor(kv_len + [0] * pad, **i32)


def inputs(num_tokens, seed, ring=RING):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, C, generator=g)
    decay, beta = -torch.rand(num_tokens, HV, generator=g), torch.rand(num_tokens, HV, generator=g)
    w = torch.randn(C, W, generator=g) * 0.5
    # Random rings: every entry is some earlier step's state, so any ring offset reads a distinct one.
    conv = torch.randn(ROWS, ring + W - 2, C, generator=g)
    ssm = torch.randn(ROWS, ring, HV, DK, DV, generator=g) * 0.3
    return tuple(a.to(DEV) for a in (x, decay, beta, w, conv, ssm))


def both(runs, num_tokens, rows, seed=0, draft_rows=False, ring=RING, **kw):
    """The reference and the kernels from the same inputs: (outputs, conv rings, state rings) of each."""
    x, decay, beta, w, conv, ssm = inputs(num_tokens, seed, ring)
    meta = batch(runs, num_tokens, draft_rows)
    rows = torch.tensor(rows, device=DEV)
    res = []
    for fn in (gated_delta_net_reference, lambda *a: gated_delta_net_triton(*a, **kw)):
        c, s = conv.clone(), ssm.clone()
        res.append((fn(x, decay, beta, w, c, s, rows, *meta), c, s))
    return res, (conv, ssm)


def check(res, untouched=(), start=None):
    (o_ref, c_ref, s_ref), (o, c, s) = res
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(c[:-1], c_ref[:-1], **TOL)  # the scratch row takes the reference's dropped writes
    torch.testing.assert_close(s[:-1], s_ref[:-1], **TOL)
    for row in untouched:
        assert torch.equal(c[row], start[0][row]) and torch.equal(s[row], start[1][row])


def test_verify_and_decode_at_different_ring_offsets():
    """Verify runs of 1 + K tokens at positions 2, 5, 9, 14 (every p0 % L and several p0 % Lc; position 2
    reads conv history before position 0 as zeros), a decode at position 0 and one at 7, a padding request
    and padding tokens: outputs and every ring entry (the state after each verified position) equal."""
    runs = [(2, 4), (5, 4), (0, 1), (9, 4), (0, 0), (14, 4)]
    res, start = both(runs, 20, rows=[3, 0, 2, 1, 4, 4])
    check(res)
    assert res[1][0][17:].abs().max() == 0  # padding tokens: zeros


def test_decode_batch_with_padding_request_rows_untouched():
    """1-token decodes at ring offsets 0..3 and two padding requests whose rows alias live ones' (as a
    padded FULL batch's block table of zeros does): nothing written through them."""
    runs = [(4, 1), (0, 0), (5, 1), (6, 1), (0, 0), (3, 1)]
    res, start = both(runs, 8, rows=[0, 4, 1, 2, 4, 3])
    check(res, untouched=[4], start=start)


def test_draft_loop_padding_rows():
    """The draft loop's layout: one token per request slot, padding slots with visible length 0."""
    runs = [(6, 1), (9, 0), (11, 1), (2, 0)]
    res, start = both(runs, 4, rows=[0, 4, 2, 3], draft_rows=True)
    check(res, untouched=[3, 4], start=start)
    assert res[1][0][[1, 3]].abs().max() == 0


def test_draft_model_ring_and_long_runs_token_by_token():
    """A draft model's ring (K + 2) with a first step of K + 2 tokens, and long runs (a 20-token prefill
    from 0, 13 tokens from 7: longer than both rings) through the recurrent kernel alone: only the last
    L states and Lc conv inputs of each run land in the rings."""
    runs = [(0, 20), (3, K + 2), (7, 13), (1, 1)]
    res, _ = both(runs, 40, rows=[2, 0, 1, 3], ring=K + 2, chunk_fn=None)
    check(res)


def chunk_twin(calls):
    """fla's chunk_gated_delta_rule interface (varlen, GVA) over the reference's chunked rule."""

    def fn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
           cu_seqlens_cpu):  # fmt: skip
        assert output_final_state and use_qk_l2norm_in_kernel and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        calls.append(cu_seqlens_cpu.tolist())
        cu, rep = cu_seqlens_cpu.tolist(), v.shape[2] // q.shape[2]
        outs, finals = [], []
        for i in range(len(cu) - 1):
            s = slice(cu[i], cu[i + 1])
            qi = (l2norm(q[:, s].float()) * scale).repeat_interleave(rep, 2)
            ki = l2norm(k[:, s].float()).repeat_interleave(rep, 2)
            o, h = chunk_gated_delta_rule(qi, ki, v[:, s].float(), g[:, s], beta[:, s], initial_state[i : i + 1], 16)
            outs.append(o)
            finals.append(h)
        return torch.cat(outs, 1).to(q.dtype), torch.cat(finals)

    return fn


def test_chunked_path_heads_then_tails():
    """Runs of >= 10 tokens send their heads (all but the last L tokens) to the chunk function, which gets
    cu_seqlens and the states before the runs; tails continue from the head's final state in the ring."""
    calls = []
    runs = [(0, 20), (2, 4), (7, 13), (0, 9), (30, 1)]
    res, _ = both(runs, 50, rows=[2, 0, 1, 3, 4], chunk_fn=chunk_twin(calls), min_run=10)
    check(res)
    assert calls == [[0, 20 - RING, 20 - RING + 13 - RING]]  # the two runs of 10+ tokens, heads only


def test_plan_is_made_once_per_forward_and_only_when_shapes_allow():
    qsl, _, kvl = batch([(0, 20), (5, 4)], 24)
    assert chunked.maybe_plan(qsl, kvl, 24, RING, min_run=24) is None  # T - B + 1 = 23: no run can reach 24
    first = chunked.maybe_plan(qsl, kvl, 24, RING, min_run=10)
    assert first is chunked.maybe_plan(qsl, kvl, 24, RING, min_run=10)  # the next layer: no second read
    assert first.skip.tolist() == [20 - RING, 0] and first.first_entry.tolist() == [RING - 1]
    assert first.has_state.tolist() == [False] and first.last_entry.tolist() == [(20 - RING - 1) % RING]
    kvl[0] = 3  # an in-place write (the builder's next copy): a new plan
    assert chunked.maybe_plan(qsl, kvl, 24, RING, min_run=10) is not first


def test_op_dispatches_to_the_kernels():
    assert linear_attention_impl("triton") == "triton" and linear_attention_impl("sdpa") == "reference"
    check_linear_attention("triton", DEV)  # on the CPU: under the interpreter
    with pytest.raises(ValueError, match="'fast' is unknown; choose one of"):
        check_linear_attention("fast", "cpu")
    x, decay, beta, w, conv, ssm = inputs(6, 1)
    meta = batch([(3, 4), (0, 2)], 6)
    args = (x, decay, beta, w)
    rows = torch.tensor([1, 0], device=DEV)
    ref = gated_delta_net_reference(*args, conv.clone(), ssm.clone(), rows, *meta)
    got = torch.ops.draftgraph.gated_delta_net(*args, conv, ssm, rows, *meta, "triton")
    torch.testing.assert_close(got, ref, **TOL)
