"""The n-gram drafter's per-slot token history on the device, and its proposal inside the step.

`NgramState` keeps, per request slot (the last row is scratch for padding rows), the request's tokens so far
(prompt and emitted output) in a [slots, max_model_len + K + 1] int32 buffer and their count. The host writes a
slot's row once, when its request starts a prefill at position 0 (`admit`: a new request, or one recomputed after
a preemption, with its output so far); every step appends the tokens it emitted on the device (`record`), then
proposes K drafts per request from the history (`propose`: models/drafters/ngram_match.py), so a step needs
nothing from the host and overlapped steps work as they do for model drafters. No model forward runs.

Padding: where no n-gram recurs (or fewer than K tokens follow the match) the remaining drafts are `pad_id` and
are verified like any draft. That is exact: a greedy row keeps only drafts equal to the target's own choice, and a
sampled row's q is one-hot at the padded token too (runtime/rejection.py), so it is accepted with probability
p(pad) and the recovery draw leaves it out. Acceptance statistics therefore count an accepted padding token (it is
a token the target emitted). Writes past the buffer's end (a step may emit up to K + 1 tokens past max_tokens,
which the host drops) land in the last column, which a request that long never reads again.
"""

from __future__ import annotations

import torch

from draftgraph.models.drafters.ngram_match import ngram_propose


class NgramState:
    """Per request slot device history of the n-gram drafter (`max_num_seqs` slots plus a scratch row)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, k: int, n_min: int, n_max: int, device, pad_id=0):
        self.scratch, self.k, self.n_min, self.n_max, self.pad_id = max_num_seqs, k, n_min, n_max, pad_id
        self.width = max_model_len + k + 1
        dev = torch.device(device)
        self.history = torch.zeros(max_num_seqs + 1, self.width, dtype=torch.int32, device=dev)  # read in place
        self.lengths = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=dev)
        self.device = dev

    # ---- the host side ------------------------------------------------------------------------------

    def admit(self, reqs) -> None:
        """Write the rows of requests starting a prefill at position 0: their prompt and output so far."""
        for r in reqs:
            tokens = r.tokens[: self.width]
            self.history[r.slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32).to(
                self.device, non_blocking=True
            )
            self.lengths[r.slot] = len(tokens)

    # ---- the device side ----------------------------------------------------------------------------

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Append tokens [B, R] emitted by requests in slots [B], the first num_emitted [B] of each row (padding
        rows: the scratch slot). In place, on the device."""
        b, r = tokens.shape
        j = torch.arange(r, device=tokens.device)[None, :]
        keep = j < num_emitted[:, None]  # [B, R]
        col = (self.lengths[slots][:, None] + j).clamp_max(self.width - 1)
        flat = torch.where(keep, slots[:, None] * self.width + col, self.scratch * self.width + j)  # others: scratch
        self.history.view(-1).index_put_((flat.reshape(-1),), tokens.reshape(-1).to(torch.int32))
        self.lengths.index_add_(0, slots, num_emitted.long())

    def propose(self, slots: torch.Tensor) -> torch.Tensor:
        """K drafts [B, K] (int64) for the requests in slots [B], from their histories."""
        lengths = self.lengths[slots].clamp_max(self.width)
        drafts, _ = ngram_propose(self.history[slots], lengths, self.k, self.n_min, self.n_max, self.pad_id)
        return drafts.long()

    def step(self, slots: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
        """`record` the step's emitted tokens, then `propose` from the histories that include them."""
        self.record(slots, tokens, num_emitted)
        return self.propose(slots)
