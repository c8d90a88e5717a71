"""Token choice on the device: greedy, temperature with top-k / top-p, and per-(seed, position) noise.

Randomness is a counter-based hash of (request seed, token position, purpose), not a stateful generator:
the same request and position always draw the same noise whatever the batch around it, nothing syncs
with the host, and the code can sit inside a captured graph. Sampling uses the exponential race
(argmax p / E with E ~ Exp(1)), which draws exactly from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF

# Purposes get distinct noise streams so no two decisions share a uniform.
SALT_TARGET = 0x1B873593  # sampling the target (plain decode, bonus and recovery tokens)
SALT_DRAFT = 0x2D8F1C35  # sampling draft tokens
SALT_ACCEPT = 0x5BD1E995  # acceptance uniforms of the rejection sampler


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values in [0, 2^32); products stay < 2^63."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & _MASK
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int = 0) -> torch.Tensor:
    """Uniforms in (0, 1), float32: [N] when width == 0, else [N, width] (one per vocabulary entry)."""
    base = _mix32(_mix32(seeds.long() ^ salt) + positions.long())  # [N]
    if width:
        cols = _mix32(torch.arange(width, device=seeds.device, dtype=torch.long) * 0x3C6EF373 + salt)
        base = _mix32(base[:, None] ^ cols[None, :])  # [N, width]
    return ((base >> 8).float() + 0.5) * (1.0 / (1 << 24))


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
    code around it, and the sort over the vocabulary runs as ATen kernels (inside CUDA graphs all the same),
    which spares each sampled draft-loop piece a long compile of its own."""
    if torch.compiler.is_compiling():
        return torch.ops.draftgraph.sampling_probs(logits, st.temperature, st.top_k, st.top_p)
    return _probabilities(logits, st.temperature, st.top_k, st.top_p)


def _probabilities(logits, temperature, top_k, top_p) -> torch.Tensor:
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logits = logits / temp[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p (top_p == 1 keeps everything, rounding aside).
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(-1))
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


# Registering the op is this module's one import-time action (once per process, before any graph naming it
# is traced or loaded from artifacts).
@torch.library.custom_op("draftgraph::sampling_probs", mutates_args=())
def _sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    return _probabilities(logits, temperature, top_k, top_p)


@_sampling_probs.register_fake
def _(logits, temperature, top_k, top_p):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One token per row from probs [N, V] by the exponential race with hashed noise."""
    u = uniform_noise(seeds, positions, salt, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(-1)


def sample(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, salt: int = SALT_TARGET):
    """Token ids [N] for logits [N, V]: argmax for greedy rows, a draw from the processed distribution else."""
    greedy_ids = logits.argmax(-1)
    if st.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(probabilities(logits, st), st.seeds, positions, salt)
    return torch.where(st.temperature <= 0, greedy_ids, sampled)
