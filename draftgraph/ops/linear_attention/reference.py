"""PyTorch reference of `torch.ops.draftgraph.gated_delta_net` (the oracle; op.py holds the contract).

No host reads anywhere (every loop bound comes from shapes), so it can sit inside CUDA graphs of any batch.
Per request run of n tokens (ring length L = ssm_states.shape[1]):
- the short causal conv over [history from the conv ring | the run's inputs], then SiLU;
- the run's first n - L tokens (its "head", non-empty only for prefill chunks) by the chunked gated delta
  rule (`chunk_gated_delta_rule`, chunks of 64, on a [B, T - L] padded layout);
- its last min(n, L) tokens (its "tail": all of a decode or verify run) token by token
  (`recurrent_step`), keeping the state after each: those are what the ring stores.
The recurrence for each v head, S in [Dk, Dv]: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dim (as FLA and transformers)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(s, q, k, v, g, beta):
    """One token for a batch of states. s [N, H, Dk, Dv]; q, k [N, H, Dk]; v [N, H, Dv]; g, beta [N, H] (all
    float32, q already scaled). Returns (new state, output [N, H, Dv])."""
    s = s * g.exp()[..., None, None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", s, k)
    s = s + k[..., :, None] * ((v - kv_mem) * beta[..., None])[..., None, :]
    return s, torch.einsum("nhkv,nhk->nhv", s, q)


def chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk: int = CHUNK):
    """The gated delta rule over padded runs, by chunks (the UT transform inside each chunk, a scan over chunks).
    q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; h0 [B, H, Dk, Dv]; all float32, q scaled. Padding
    tokens must have g = beta = 0 (they leave the state unchanged). Returns (o [B, T, H, Dv], final state)."""
    b, t, h, dk = k.shape
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))  # [B, H, Tp, D]
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))  # [B, H, Tp]
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [B, H, N, C]: log decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, N, C, C]
    ut = (k_beta @ k.transpose(-1, -2)) * decay  # I + strictly lower part: solved as unitriangular
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = h0
    out = torch.zeros_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q_dec[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk, -1)[:, :, :t].transpose(1, 2)
    return out, s


def gated_delta_net_reference(
    x, g, beta, conv_weight, conv_states, ssm_states, req_rows, query_start_loc, token_req, token_kv_len
) -> torch.Tensor:
    num_tokens, conv_dim = x.shape
    rows_total, ring, hv, dk, dv = ssm_states.shape
    conv_ring, width = conv_states.shape[1], conv_weight.shape[1]
    hk = (conv_dim - hv * dv) // (2 * dk)
    b = req_rows.shape[0]
    out = x.new_zeros(num_tokens, hv, dv)
    if num_tokens == 0 or b == 0:
        return out
    dev, scratch = x.device, rows_total - 1
    t_idx = torch.arange(num_tokens, device=dev)
    valid = token_kv_len > 0  # padding tokens see nothing and write nothing
    pos = (token_kv_len.long() - 1).clamp(min=0)
    run = token_req.long().clamp(0, b - 1)
    off = t_idx - query_start_loc.long()[run]  # offset inside the run
    n = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, run, valid.long())  # tokens per run
    start = query_start_loc[:-1].long().clamp(max=num_tokens - 1)
    p0 = torch.where(n > 0, pos[start], 0)  # position of each run's first token
    rows = req_rows.long()
    tok_row = rows[run]

    # The conv: tap j reads the input W-1-j positions back: this run's, else the ring's, else zero (before 0).
    back = torch.arange(width - 1, -1, -1, device=dev)
    src_pos = pos[:, None] - back
    in_run = (off[:, None] - back) >= 0
    win = torch.where(
        in_run[..., None],
        x[(t_idx[:, None] - back).clamp(min=0)],
        torch.where((src_pos >= 0)[..., None], conv_states[tok_row[:, None], src_pos.remainder(conv_ring)], 0),
    )  # [T, W, conv_dim]
    conv = F.silu((win.float() * conv_weight.t().float()).sum(1)).to(x.dtype)  # [T, conv_dim]

    # Initial state per run: the ring's state after the position before its first token (zero at position 0).
    h0 = ssm_states[rows, (p0 - 1).remainder(ring)]
    h0 = torch.where(((p0 > 0) & (n > 0))[:, None, None, None], h0, 0.0)
    # Then the ring writes: the conv inputs of each run's last conv_ring tokens (others to the scratch row).
    write = valid & (off >= n[run] - conv_ring)
    conv_states[torch.where(write, tok_row, scratch), torch.where(write, pos, t_idx).remainder(conv_ring)] = x.to(
        conv_states.dtype
    )

    qc, kc, vc = conv.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = (l2norm(qc.view(-1, hk, dk)) * dk**-0.5).repeat_interleave(hv // hk, dim=1)  # [T, HV, Dk]
    k = l2norm(kc.view(-1, hk, dk)).repeat_interleave(hv // hk, dim=1)
    v = vc.view(-1, hv, dv)
    g, beta = g.float(), beta.float()

    s = h0
    head = valid & (off < n[run] - ring)
    head_len = num_tokens - ring  # the longest head a run can have
    if head_len > 0:
        bi, ti = torch.where(head, run, b), torch.where(head, off, 0).clamp(max=head_len - 1)
        padded = []
        for val in (q, k, v, g, beta):
            buf = val.new_zeros(b + 1, head_len, *val.shape[1:])
            buf[bi, ti] = torch.where(head.view(-1, *[1] * (val.dim() - 1)), val, 0)
            padded.append(buf[:b])
        chunk = min(CHUNK, 1 << (head_len - 1).bit_length())  # short heads (decode batches): a small chunk
        o_head, s = chunk_gated_delta_rule(*padded, h0, chunk)
        out = torch.where(head[:, None, None], o_head[run, off.clamp(0, head_len - 1)], out.float())

    # The tail: the last min(n, L) tokens of each run, one at a time, keeping every state.
    tail_off = n[:, None] - ring + torch.arange(ring, device=dev)  # [B, L]
    active = tail_off >= 0
    tok = (start[:, None] + tail_off).clamp(0, num_tokens - 1)
    states, outs = [], []
    for j in range(ring):
        a, t = active[:, j], tok[:, j]
        gj, bj = torch.where(a[:, None], g[t], 0.0), torch.where(a[:, None], beta[t], 0.0)
        s, o = recurrent_step(s, q[t], k[t], v[t], gj, bj)
        states.append(s)
        outs.append(o)
    col = torch.where(active, p0[:, None] + tail_off, torch.arange(ring, device=dev)).remainder(ring)
    ssm_states[torch.where(active, rows[:, None], scratch), col] = torch.stack(states, 1)
    tail_i = off - (n[run] - ring)
    is_tail = valid & (tail_i >= 0)
    o_tail = torch.stack(outs, 1)[run, tail_i.clamp(0, ring - 1)]  # [T, HV, Dv]
    out = torch.where(is_tail[:, None, None], o_tail, out.float())
    return out.to(x.dtype)
