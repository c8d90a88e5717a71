"""Prompt lookup (n-gram) drafting on the device: the matcher an n-gram drafter runs inside the step graph.

For each request, the last n tokens of its history (prompt + output so far) are looked up earlier in that history,
longest n first (n from `n_max` down to `n_min`); at the latest earlier occurrence, the K tokens that followed it
are the drafts. Fewer than K follow it (the match ends near the history's end), or nothing matches: the drafts are
padded. Padding is harmless to losslessness: a deterministic drafter's proposal is one token with probability 1,
so rejection sampling keeps the target's distribution whatever the padded token is (and greedy acceptance only
keeps tokens the target itself chose).

Fixed shapes and no host reads (the same code at every step, inside a CUDA graph): history is a [B, L] buffer
with per-row valid lengths; every n is tried for every row and the longest that matched wins by `torch.where`.
Not wired into the engine yet (issue 46's n-gram drafter: the per-slot history buffer the step must keep).
"""

from __future__ import annotations

import torch


def ngram_propose(
    history: torch.Tensor,  # [B, L] token ids; row b's valid tokens are history[b, :lengths[b]]
    lengths: torch.Tensor,  # [B] int64, each in [0, L]
    k: int,  # drafts per row
    n_min: int,
    n_max: int,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (drafts [B, K] int64, num_proposed [B] int64): row b proposes drafts[b, :num_proposed[b]], the
    rest is `pad_id`. num_proposed is 0 where no n-gram of the allowed sizes recurs."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n-gram sizes n_min={n_min}, n_max={n_max} must satisfy 1 <= n_min <= n_max, e.g. 1 and 4")
    if k < 1:
        raise ValueError(f"k={k} drafts per row must be at least 1")
    b, width = history.shape
    dev = history.device
    lengths = lengths.long()
    cols = torch.arange(width, device=dev)
    best_start = torch.full((b,), -1, dtype=torch.long, device=dev)  # where the continuation starts (j + n)
    for n in range(n_max, n_min - 1, -1):  # longest first: a longer match only replaces "no match yet"
        if n >= width:
            continue
        suffix_cols = (lengths[:, None] - n + torch.arange(n, device=dev)[None, :]).clamp(0, width - 1)  # [B, n]
        suffix = history.gather(1, suffix_cols)  # [B, n] the last n tokens
        windows = history.unfold(1, n, 1)  # [B, L - n + 1, n]: windows[b, j] = history[b, j : j + n]
        starts = cols[: width - n + 1]
        # An occurrence strictly before the suffix itself, with at least one token after it inside the history.
        usable = (starts[None, :] + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
        match = (windows == suffix[:, None, :]).all(-1) & usable  # [B, L - n + 1]
        latest = torch.where(match, starts[None, :], -1).amax(-1)  # [B] the latest occurrence, -1: none
        found = (latest >= 0) & (best_start < 0)
        best_start = torch.where(found, latest + n, best_start)
    offsets = best_start[:, None] + torch.arange(k, device=dev)[None, :]  # [B, K]
    proposed = ((lengths - best_start).clamp(0, k) * (best_start >= 0)).long()  # [B]
    drafts = history.gather(1, offsets.clamp(0, width - 1))
    valid = torch.arange(k, device=dev)[None, :] < proposed[:, None]
    return torch.where(valid, drafts, torch.full_like(drafts, pad_id)), proposed
