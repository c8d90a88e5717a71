"""The gated_delta_net op's PyTorch reference: its chunked form against the token-by-token recurrence,
the whole op against transformers' conv and recurrent functions over two steps of ragged runs (state
rings by position, padding untouched), and no value read back to the host (it runs on meta tensors).
Tolerance: 1e-5 (float32 in a different order)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from draftgraph.ops.linear_attention.reference import (
    chunk_gated_delta_rule,
    gated_delta_net_reference,
    l2norm,
    recurrent_step,
)

HK, HV, DK, DV, W = 2, 4, 8, 6, 4
C = 2 * HK * DK + HV * DV
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_equals_token_by_token(chunk):
    g = torch.Generator().manual_seed(chunk)
    b, t = 3, 37
    q = l2norm(torch.randn(b, t, HV, DK, generator=g)) * DK**-0.5
    k = l2norm(torch.randn(b, t, HV, DK, generator=g))
    v = torch.randn(b, t, HV, DV, generator=g)
    decay, beta = -torch.rand(b, t, HV, generator=g), torch.rand(b, t, HV, generator=g)
    beta[2, 30:] = decay[2, 30:] = 0  # padding at the end of one run: the state must stay put
    h0 = torch.randn(b, HV, DK, DV, generator=g)
    out, s = chunk_gated_delta_rule(q, k, v, decay, beta, h0, chunk)
    s_ref, outs = h0, []
    for i in range(t):
        s_ref, o = recurrent_step(s_ref, q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i])
        outs.append(o)
    torch.testing.assert_close(out, torch.stack(outs, 1), **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


def dense(x, g, beta, w):
    """One request from position 0 through transformers' functions: the conv, then the recurrence."""
    t = x.shape[0]
    conv = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=W - 1, groups=C)[..., :t])[0].t()
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], -1)
    o, s = torch_recurrent_gated_delta_rule(
        q.view(1, t, HK, DK), k.view(1, t, HK, DK), v.view(1, t, HV, DV), g[None], beta[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0], s[0]


def batch(runs, num_tokens):
    """Metadata of runs [(first position, length)], padded to num_tokens with padding tokens."""
    qsl, req, kv_len = [0], [], []
    for r, (p0, n) in enumerate(runs):
        qsl.append(qsl[-1] + n)
        req += [r] * n
        kv_len += list(range(p0 + 1, p0 + n + 1))
    pad = num_tokens - len(req)
    i32 = dict(dtype=torch.int32)
    return torch.tensor(qsl, **i32), torch.tensor(req + [0] * pad, **i32), torch.tensor(kv_len + [0] * pad, **i32)


def test_op_matches_transformers_over_two_steps():
    """Step 1: prefills of 20, 1 and 3 tokens and an empty run; step 2: 70 more tokens of the first request
    (a chunked head) and 2 of the third. Outputs, the ring entries by position, padding rows zero."""
    gen = torch.Generator().manual_seed(0)
    ring, rows = 3, 5
    conv_ring = ring + W - 2
    w = torch.randn(C, W, generator=gen) * 0.5
    x = torch.randn(96, C, generator=gen)
    g, beta = -torch.rand(96, HV, generator=gen), torch.rand(96, HV, generator=gen)
    conv_states, ssm = torch.zeros(rows, conv_ring, C), torch.zeros(rows, ring, HV, DK, DV)
    # tokens in x: request 0 at 0..19 then 24..93, request 1 at 20, request 2 at 21..23 then 94..95 (row 3)
    qsl, req, kvl = batch([(0, 20), (0, 1), (0, 3), (0, 0)], 30)
    out1 = gated_delta_net_reference(x[:30], g[:30], beta[:30], w, conv_states, ssm, torch.tensor([0, 1, 3, 2]),
                                     qsl, req, kvl)  # fmt: skip
    assert out1[24:].abs().max() == 0 and ssm[2].abs().max() == 0  # padding; the empty run's row
    qsl, req, kvl = batch([(20, 70), (3, 2)], 72)
    out2 = gated_delta_net_reference(x[24:], g[24:], beta[24:], w, conv_states, ssm, torch.tensor([0, 3]), qsl, req,
                                     kvl)  # fmt: skip
    for row, idx, outs in (
        (0, list(range(20)) + list(range(24, 94)), torch.cat([out1[:20], out2[:70]])),
        (1, [20], out1[20:21]),
        (3, [21, 22, 23, 94, 95], torch.cat([out1[21:24], out2[70:]])),
    ):
        o, s = dense(x[idx], g[idx], beta[idx], w)
        n = len(idx)
        torch.testing.assert_close(outs, o, **TOL)
        torch.testing.assert_close(ssm[row, (n - 1) % ring], s, **TOL)  # the state after the last position
        kept = range(max(0, n - conv_ring), n)
        torch.testing.assert_close(conv_states[row, [p % conv_ring for p in kept]], x[[idx[p] for p in kept]])


def test_reference_reads_nothing_back_to_the_host():
    """On meta tensors any value read (.item(), boolean masks, nonzero) fails: the whole reference runs."""
    t, b, ring = 40, 3, 4
    meta = dict(device="meta")
    out = gated_delta_net_reference(
        torch.empty(t, C, **meta), torch.empty(t, HV, **meta), torch.empty(t, HV, **meta), torch.empty(C, W, **meta),
        torch.empty(b + 1, ring + W - 2, C, **meta), torch.empty(b + 1, ring, HV, DK, DV, **meta),
        torch.empty(b, dtype=torch.long, **meta), torch.empty(b + 1, dtype=torch.int32, **meta),
        torch.empty(t, dtype=torch.int32, **meta), torch.empty(t, dtype=torch.int32, **meta),
    )  # fmt: skip
    assert out.shape == (t, HV, DV) and out.device.type == "meta"
