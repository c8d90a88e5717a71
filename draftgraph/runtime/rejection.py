"""Rejection sampling for speculative decoding, all on the device.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the target's
next token. Sampling rows accept draft x with probability min(1, p(x) / q(x)); at the first rejection
they emit a draw from normalize(max(p - q, 0)); when all K drafts pass they emit a draw from p at K+1.
That output has exactly the target's distribution p (Leviathan et al. 2023; Chen et al. 2023). Deterministic
drafts (the n-gram drafter) pass no q: it is one-hot at each draft (accept with p(x); recover from p without x).

Pinned acceptance (CompileConfig.synthetic_acceptance, benchmarks only): `synthetic_accept` draws the decision
instead, draft i accepted iff every earlier one was and u_i < rate_i, in the same graphs (see its docstring).
"""

from __future__ import annotations

import torch

from draftgraph.ops.sampling.noise import uniform_noise
from draftgraph.ops.sampling.op import greedy_argmax
from draftgraph.runtime.sampler import SALT_ACCEPT, SALT_TARGET, SamplingTensors, probabilities, sample_from_probs

SALT_SYNTHETIC = 0x27D4EB2F  # pinned acceptance's uniforms: a stream of their own


def rejection_sample(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K] target-vocabulary ids
    draft_probs: torch.Tensor | None,  # [B, K, V] draft distribution q; None: all greedy, or one-hot (deterministic)
    st: SamplingTensors,  # per request
    positions: torch.Tensor,  # [B, K+1] position of each token the verify rows predict
    race_kernel: bool,  # OpChoices.race_sampler: the recovered draw's kernel (sampler.sample_from_probs)
    synthetic: tuple[float, ...] = (),  # ResolvedConfig.synthetic_acceptance: pinned rates (greedy requests only)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K+1], num_accepted [B]); row b emits tokens[b, : num_accepted[b] + 1]."""
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    target_argmax = greedy_argmax(target_logits)  # [B, K+1]
    if synthetic:
        return synthetic_accept(target_argmax, draft_ids, positions, synthetic)
    greedy_match = (draft_ids == target_argmax[:, :k]).long()
    greedy_accepted = greedy_match.cumprod(-1).sum(-1)  # [B]
    if st.all_greedy:
        return target_argmax, greedy_accepted  # tokens before the first mismatch equal the drafts

    p = probabilities(target_logits.reshape(b * k1, vocab), st.repeat(k1)).view(b, k1, vocab)
    q = draft_probs
    p_draft = p[:, :k].gather(-1, draft_ids[..., None])[..., 0]  # [B, K]
    # Deterministic drafts (the n-gram drafter, q None): q is one-hot at each draft, so q(x) = 1 and the residual
    # max(p - onehot(x), 0) is p with x removed.
    q_draft = q.gather(-1, draft_ids[..., None])[..., 0] if q is not None else torch.ones_like(p_draft)
    u = uniform_noise(st.seeds.repeat_interleave(k), positions[:, :k].reshape(-1), SALT_ACCEPT).view(b, k)
    accept = (u * q_draft <= p_draft).long()  # u <= p/q without dividing by a zero q
    accepted = accept.cumprod(-1).sum(-1)  # [B]

    # The emitted token at row `accepted` (the first rejection, or K: the bonus) is the only draw kept, so only
    # that row's distribution is built: [B, V] instead of [B, K+1, V] (graph memory of the sampled step). Its
    # noise is keyed by (seed, position) as before, so the tokens are the same as drawing at every row.
    rows = accepted[:, None, None].expand(b, 1, vocab)
    p_row = p.gather(1, rows)[:, 0]  # [B, V]
    if k:
        if q is not None:
            q_row = q.gather(1, rows.clamp_max(k - 1))[:, 0]
            residual = (p_row - q_row).clamp_min(0)
        else:  # one-hot q: the rejected draft's probability removed
            residual = p_row.scatter(1, draft_ids.gather(1, accepted.clamp_max(k - 1)[:, None]), 0.0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)
        p_row = torch.where((accepted == k)[:, None], p_row, residual)  # row K: the bonus draw from p
    row_pos = positions.gather(1, accepted[:, None])[:, 0]
    recovered = sample_from_probs(p_row, st.seeds, row_pos, SALT_TARGET, race_kernel)  # [B]
    idx = torch.arange(k1, device=target_logits.device)[None, :]
    padded_drafts = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)
    sampled_tokens = torch.where(idx < accepted[:, None], padded_drafts, recovered[:, None])

    greedy = st.temperature <= 0
    tokens = torch.where(greedy[:, None], target_argmax, sampled_tokens)
    return tokens, torch.where(greedy, greedy_accepted, accepted)


def synthetic_accept(
    target_argmax: torch.Tensor,  # [B, K+1] the target's greedy token at each verify row
    draft_ids: torch.Tensor,  # [B, K]
    positions: torch.Tensor,  # [B, K+1] position of each token the verify rows predict
    rates: tuple[float, ...],  # conditional acceptance rate per draft position (at most K; later ones: 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pinned acceptance: draft i is accepted iff drafts 0..i-1 were and u_i < rates[i], so P(i accepted) =
    prod_{j<=i} rates[j] and the mean tokens per step is 1 + sum_i prod_{j<=i} rates[j]. Accepted rows emit the
    drafts, the row after them the target's token (its argmax given those drafts). Only the decision differs from
    greedy acceptance: the same graphs, kernels and shapes run.

    u_i comes from the counter-based noise (no state, no host work): keyed by the row's first draft and by
    (first predicted position) x (K+1) + i. A request's first predicted position grows every step, so no
    (position, i) pair repeats and its decisions are independent across steps and positions."""
    b, k1 = target_argmax.shape
    k = k1 - 1
    idx = torch.arange(k, device=target_argmax.device)
    keys = positions[:, :1] * k1 + idx[None, :]  # [B, K]
    seeds = draft_ids[:, :1].expand(b, k)
    u = uniform_noise(seeds.reshape(-1), keys.reshape(-1), SALT_SYNTHETIC).view(b, k)
    passed = torch.stack([u[:, i] < (rates[i] if i < len(rates) else 0.0) for i in range(k)], dim=1)  # [B, K]
    accepted = passed.long().cumprod(-1).sum(-1)  # [B]
    padded_drafts = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)  # [B, K+1]
    rows = torch.arange(k1, device=target_argmax.device)[None, :]
    return torch.where(rows < accepted[:, None], padded_drafts, target_argmax), accepted
