"""Rejection sampling for speculative decoding, all on the device.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the target's
next token. Sampling rows accept draft x with probability min(1, p(x) / q(x)); at the first rejection
they emit a draw from normalize(max(p - q, 0)); when all K drafts pass they emit a draw from p at K+1.
That output has exactly the target's distribution p (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import torch

from draftgraph.ops.sampling.noise import uniform_noise
from draftgraph.ops.sampling.op import greedy_argmax
from draftgraph.runtime.sampler import SALT_ACCEPT, SALT_TARGET, SamplingTensors, probabilities, sample_from_probs


def rejection_sample(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K] target-vocabulary ids
    draft_probs: torch.Tensor | None,  # [B, K, V] processed draft distribution q (None when all greedy)
    st: SamplingTensors,  # per request
    positions: torch.Tensor,  # [B, K+1] position of each token the verify rows predict
    race_kernel: bool,  # OpChoices.race_sampler: the recovered draw's kernel (sampler.sample_from_probs)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K+1], num_accepted [B]); row b emits tokens[b, : num_accepted[b] + 1]."""
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    target_argmax = greedy_argmax(target_logits)  # [B, K+1]
    greedy_match = (draft_ids == target_argmax[:, :k]).long()
    greedy_accepted = greedy_match.cumprod(-1).sum(-1)  # [B]
    if st.all_greedy:
        return target_argmax, greedy_accepted  # tokens before the first mismatch equal the drafts

    p = probabilities(target_logits.reshape(b * k1, vocab), st.repeat(k1)).view(b, k1, vocab)
    q = draft_probs
    p_draft = p[:, :k].gather(-1, draft_ids[..., None])[..., 0]  # [B, K]
    q_draft = q.gather(-1, draft_ids[..., None])[..., 0]
    u = uniform_noise(st.seeds.repeat_interleave(k), positions[:, :k].reshape(-1), SALT_ACCEPT).view(b, k)
    accept = (u * q_draft <= p_draft).long()  # u <= p/q without dividing by a zero q
    accepted = accept.cumprod(-1).sum(-1)  # [B]

    # The emitted token at row `accepted` (the first rejection, or K: the bonus) is the only draw kept, so only
    # that row's distribution is built: [B, V] instead of [B, K+1, V] (graph memory of the sampled step). Its
    # noise is keyed by (seed, position) as before, so the tokens are the same as drawing at every row.
    rows = accepted[:, None, None].expand(b, 1, vocab)
    p_row = p.gather(1, rows)[:, 0]  # [B, V]
    if k:
        q_row = q.gather(1, rows.clamp_max(k - 1))[:, 0]
        residual = (p_row - q_row).clamp_min(0)
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
