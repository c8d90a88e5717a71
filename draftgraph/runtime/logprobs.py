"""Logprobs of the target's raw logits, gathered on the device and read back with the step's one copy.

A step that asks for logprobs takes, for every row it samples from (each verify row, each last prompt chunk),
the log-softmax of the target's raw logits (before temperature, penalties and top-k / top-p: vLLM's default)
at the token the row emits, and the `MAX_LOGPROBS` likeliest tokens with theirs. Top-k of the logits is top-k
of the log-softmax (a shift), so no [N, V] log-softmax is materialised: values = logits - logsumexp(logits).

The values travel in the step's packed int64 result as float64 bit patterns (exact); `unpack` reads them back.
The host keeps, per emitted token, the chosen token and the request's first `logprobs` ids of the top list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftgraph.ops.logits.logprobs import gather_packed

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (vLLM's default max_logprobs); fixed graph shape


def top_width(vocab_size: int) -> int:
    """The top-k width a step gathers: MAX_LOGPROBS, or the whole vocabulary when it is smaller."""
    return min(MAX_LOGPROBS, vocab_size)


def gather_logprobs(logits: torch.Tensor, chosen: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """Packed int64 [N * (2n + 1)] for logits [N, V] and the chosen token of each row [N]:
    [top ids (N x n) | chosen logprob (N) and top logprobs (N x n), float64 bits]. ops/logits/logprobs.py: the
    Triton kernels on CUDA with `kernel` (OpChoices.logits_kernels), the torch ops elsewhere."""
    return gather_packed(logits, chosen, top_width(logits.shape[-1]), kernel)


def packed_size(num_rows: int, vocab_size: int) -> int:
    return num_rows * (2 * top_width(vocab_size) + 1)


@dataclass(frozen=True)
class RowLogprobs:
    """One sampled row's logprobs on the host: its chosen token's, and the top list (likeliest first)."""

    chosen: float
    top_ids: list[int]
    top_values: list[float]

    def entry(self, token: int, num_top: int) -> dict[int, float]:
        """The output dict for emitted `token`: it and the first `num_top` of the top list -> logprob."""
        out = dict(zip(self.top_ids[:num_top], self.top_values[:num_top]))
        out[token] = self.chosen
        return out


def unpack(host: list[int], num_rows: int, vocab_size: int) -> list[RowLogprobs]:
    """`gather_logprobs`'s packed values (as read by the host) back into one RowLogprobs per row."""
    n = top_width(vocab_size)
    ids = host[: num_rows * n]
    vals = np.asarray(host[num_rows * n : num_rows * (2 * n + 1)], dtype=np.int64).view(np.float64).tolist()
    return [
        RowLogprobs(vals[i * (n + 1)], ids[i * n : (i + 1) * n], vals[i * (n + 1) + 1 : (i + 1) * (n + 1)])
        for i in range(num_rows)
    ]
