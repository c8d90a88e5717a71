"""Token choice on the device: greedy, temperature with top-k / top-p, and per-(seed, position) noise.

Randomness is a counter-based hash of (request seed, token position, purpose), not a stateful generator
(ops/sampling/noise.py): the same request and position always draw the same noise whatever the batch around
it, nothing syncs with the host, and the code can sit inside a captured graph. Sampling uses the exponential
race (argmax p / E with E ~ Exp(1)), which draws exactly from p.

Top-k and top-p never sort the vocabulary: ops/sampling/probs.py (`draftgraph::sampling_probs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.ops.sampling.noise import race_reference
from draftgraph.ops.sampling.op import greedy_argmax
from draftgraph.ops.sampling.probs import probabilities_op

# Purposes get distinct noise streams so no two decisions share a uniform.
SALT_TARGET = 0x1B873593  # sampling the target (plain decode, bonus and recovery tokens)
SALT_DRAFT = 0x2D8F1C35  # sampling draft tokens
SALT_ACCEPT = 0x5BD1E995  # acceptance uniforms of the rejection sampler


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device (rows = the logits rows being sampled)."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1 = off
    seeds: torch.Tensor  # [N] int64
    greedy_rows: tuple[bool, ...]  # host copy of temperature == 0 per row

    @property
    def all_greedy(self) -> bool:
        """Host-known: when every row is greedy, probability work is skipped entirely."""
        return all(self.greedy_rows)

    def rows(self, index: slice) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[index], self.top_k[index], self.top_p[index], self.seeds[index], self.greedy_rows[index]
        )

    def repeat(self, n: int) -> SamplingTensors:
        """Each row repeated n times in place (row i -> rows i*n .. i*n+n-1)."""
        return SamplingTensors(
            self.temperature.repeat_interleave(n),
            self.top_k.repeat_interleave(n),
            self.top_p.repeat_interleave(n),
            self.seeds.repeat_interleave(n),
            tuple(g for g in self.greedy_rows for _ in range(n)),
        )


def probabilities(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Processed probabilities [N, V] float32: temperature, then top-k, then top-p (greedy rows: one-hot).
    Inside a compiled function it is one opaque op (`draftgraph::sampling_probs`): Inductor compiles the
    code around it, and the threshold searches run as Triton kernels on CUDA, ATen ones elsewhere (inside CUDA
    graphs all the same), which spares each sampled draft-loop piece a long compile of its own."""
    return probabilities_op(logits, st.temperature, st.top_k, st.top_p)


def sample_from_probs(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int, race_kernel: bool
) -> torch.Tensor:
    """One token per row from probs [N, V] by the exponential race with hashed noise (ops/sampling/noise.py).
    Traced code keeps the torch ops (Inductor fuses the noise into the reduction). Eager code on CUDA (mode NONE,
    the one-graph step's acceptance, captured as it runs) may take the Triton race (`draftgraph::race_sample`,
    the noise in registers instead of [N, V] temporaries: on an H100 6.5-21x faster at 1-128 rows of a 128k
    vocabulary, the sampled one-graph step 5 % faster at B = 1 and 31 % at B = 32, its graph memory 404 -> 304 MiB,
    docs/performance.md); `race_kernel` (OpChoices.race_sampler) off keeps the torch ops."""
    if probs.is_cuda and not torch.compiler.is_compiling() and race_kernel:
        return torch.ops.draftgraph.race_sample(probs, seeds.long(), positions.long(), salt)
    return race_reference(probs, seeds, positions, salt)


def sample(
    logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, race_kernel: bool, salt: int = SALT_TARGET
):
    """Token ids [N] for logits [N, V]: argmax for greedy rows, a draw from the processed distribution else
    (`race_kernel`: sample_from_probs's)."""
    greedy_ids = greedy_argmax(logits)  # on CUDA the split Triton argmax (ops/sampling)
    if st.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(probabilities(logits, st), st.seeds, positions, salt, race_kernel)
    return torch.where(st.temperature <= 0, greedy_ids, sampled)
