"""The logprobs gather of a step: per row of logits [N, V], log-softmax at its chosen token and at its top n tokens.

Top-k of the logits is top-k of the log-softmax (a shift), so no [N, V] log-softmax is materialised: values =
logits - logsumexp(logits). The result is packed as the step's one copy carries it (int64 [N * (2n + 1)]):
[top ids (N x n) | chosen logprob (N) and top logprobs (N x n), float64 bits].

`gather_packed` picks the implementation: on CUDA with `kernel` (OpChoices.logits_kernels) the Triton kernels
(triton_logprobs.py: one read of the logits for the log-sum-exp and each chunk's top n, then a merge per row),
elsewhere `gather_reference` (logsumexp and torch.topk: the CPU path and the kernels' oracle).
"""

from __future__ import annotations

import torch


def gather_packed(logits: torch.Tensor, chosen: torch.Tensor, n: int, kernel: bool) -> torch.Tensor:
    """Packed int64 [N * (2n + 1)] for logits [N, V], the chosen token of each row [N] and n <= V top tokens."""
    if kernel and logits.is_cuda:
        from draftgraph.ops.logits.triton_logprobs import gather_triton  # Triton loads on first use

        return gather_triton(logits, chosen, n)
    return gather_reference(logits, chosen, n)


def gather_reference(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # [N, 1]
    top_vals, top_ids = logits.topk(n, dim=-1)  # [N, n]
    chosen_vals = logits.gather(-1, chosen[:, None].long())  # [N, 1]
    vals = torch.cat([chosen_vals.float(), top_vals.float()], dim=-1) - lse  # [N, n + 1]
    return torch.cat([top_ids.flatten(), vals.double().view(torch.int64).flatten()])
