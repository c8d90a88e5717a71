"""Greedy token choice as a custom op: `torch.ops.draftgraph.argmax_rows`, its fake and its reference.

argmax_rows(logits [N, V]) -> [N] int64 is torch.argmax(logits, -1) exactly: the first index of each row's
maximum, NaN above everything (the first NaN wins). On CUDA it runs the split Triton reduction
(triton_argmax.py: a few us at a few rows of a 128k vocabulary, where one program per row takes ~30 us); on any
other device the reference, torch.argmax. Its grid depends only on N, V and the SM count and it never reads
back to the host, so it sits inside compiled functions as one opaque node and inside any CUDA graph (FULL
included). `greedy_argmax` is what callers use: the op for CUDA logits of a supported dtype, plain
torch.argmax elsewhere (CPU tensors keep ATen's kernel and Inductor's fusion). Registering the op is this
module's one import-time action; Triton loads on the first CUDA call.
"""

from __future__ import annotations

import torch

from draftgraph.ops.registry import custom_op
from draftgraph.ops.sampling.noise import race_reference

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@custom_op("draftgraph::argmax_rows", mutates_args=())
def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 / bfloat16 / float16 (any strides) -> [N] int64: each row's first maximum."""
    if logits.is_cuda:
        from draftgraph.ops.sampling.triton_argmax import argmax_triton  # Triton loads on first use

        return argmax_triton(logits)
    return argmax_rows_reference(logits)


@argmax_rows.register_fake
def _(logits):
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes logits [N, V]; got shape {tuple(logits.shape)}: reshape to 2 dims")
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    """The oracle and the CPU path."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes logits [N, V]; got shape {tuple(logits.shape)}: reshape to 2 dims")
    return logits.argmax(-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for logits [..., V]: the custom op on CUDA (leading dims flattened into rows),
    torch.argmax on other devices and dtypes."""
    vocab = logits.shape[-1]
    if not logits.is_cuda or logits.dtype not in SUPPORTED_DTYPES or vocab == 0:
        return logits.argmax(-1)
    return torch.ops.draftgraph.argmax_rows(logits.reshape(-1, vocab)).view(logits.shape[:-1])


@custom_op("draftgraph::race_sample", mutates_args=())
def race_sample(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One token per row of probs [N, V] float32 by the exponential race with hashed noise (noise.race_reference):
    on CUDA in Triton with the noise in registers (triton_race.py), elsewhere the reference."""
    if probs.is_cuda:
        from draftgraph.ops.sampling.triton_race import race_triton  # Triton loads on first use

        return race_triton(probs, seeds, positions, salt)
    return race_reference(probs, seeds, positions, salt)


@race_sample.register_fake
def _(probs, seeds, positions, salt):
    return probs.new_empty(probs.shape[0], dtype=torch.int64)
