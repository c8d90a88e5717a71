"""Processed sampling probabilities: temperature, top-k, top-p, as the op `draftgraph::sampling_probs`.

Top-k and top-p never sort the vocabulary. Each row's logits (temperature-scaled, float32) are mapped to
int32 keys whose integer order is the float order (`_ordered_keys`), and each cut is the largest key t with
W(keys >= t) >= target, found bit by bit in exactly 32 steps (`_threshold_key`): W counts tokens for top-k
(target k) and sums the top-k-renormalised probabilities for top-p (target top_p). Every step is a compare
and a row reduction over [N, V]: fixed shapes, no host sync, capturable in a CUDA graph, [N, V] temporaries
only, no sort workspace. Each step is 5-6 ATen kernels, ~370 per call: cheap on [N, V] but launch-bound
at small N, so on CUDA the same algorithm runs as Triton kernels (ops/sampling/triton_probs.py: a radix select, 17
launches; `probabilities_torch_ops` stays the CPU path and their oracle). The kept set is the one a STABLE descending
sort keeps: tokens equal to a threshold are kept lowest vocabulary index first, exactly k for top-k and, for
top-p, while the mass before them (mass above the threshold + earlier equal tokens) stays below top_p, the
first always. Masses are float32 sums in another order than a sorted cumsum, so a token whose mass-before lies
within float rounding (~1e-6) of top_p may fall on the other side than in a sort. top_k 0 (or >= V) and
top_p 1 keep everything exactly; top_p 0 (refused by SamplingParams) keeps nothing, as the sort did (NaN).
"""

from __future__ import annotations

import torch

from draftgraph.ops.registry import custom_op
from draftgraph.ops.sampling.op import greedy_argmax


def probabilities_op(logits, temperature, top_k, top_p) -> torch.Tensor:
    """The probabilities [N, V] float32; inside a compiled function one opaque op, so Inductor compiles the code
    around it and the threshold searches run as Triton kernels on CUDA, ATen ones elsewhere."""
    if torch.compiler.is_compiling():
        return torch.ops.draftgraph.sampling_probs(logits, temperature, top_k, top_p)
    return _probabilities(logits, temperature, top_k, top_p)


_INT32_MIN = -(2**31)


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys of float32 x with the same order (-0.0 taken as +0.0): negative floats' magnitude bits flipped."""
    bits = (x + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _threshold_key(keys: torch.Tensor, weights: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """Per row [N, 1] int32: the largest t with W(keys >= t) >= target (INT32_MIN when none), where W counts
    (weights None) or sums weights. Built from the top bit down, in the order-preserving offset binary
    (t + 2^31), so 32 steps are exact; each step holds one [N, V] temporary."""
    t = torch.full((keys.shape[0], 1), _INT32_MIN, dtype=torch.int32, device=keys.device)  # offset form 0
    for bit in range(31, -1, -1):
        cand = t ^ (_INT32_MIN if bit == 31 else 1 << bit)  # t with this bit set (bit 31: the flipped sign bit)
        at_least = keys >= cand  # [N, V]
        if weights is None:
            w = at_least.sum(-1, keepdim=True, dtype=torch.int32)
        else:
            w = (weights * at_least).sum(-1, keepdim=True)
        t = torch.where(w >= target, cand, t)
    return t


def _first_ties(ties: torch.Tensor) -> torch.Tensor:
    """1-based rank of each tie in its row, lowest vocabulary index first (0 where not a tie)."""
    return ties.cumsum(-1, dtype=torch.int32) * ties


def _probabilities(logits, temperature, top_k, top_p) -> torch.Tensor:
    """Triton kernels on CUDA (ops/sampling/triton_probs.py: the same algorithm, ~17 launches instead of ~370), the
    torch-ops version elsewhere."""
    if logits.is_cuda:
        from draftgraph.ops.sampling.triton_probs import probabilities_triton  # Triton loads on first use

        return probabilities_triton(logits, temperature, top_k, top_p)
    return probabilities_torch_ops(logits, temperature, top_k, top_p)


def probabilities_torch_ops(logits, temperature, top_k, top_p) -> torch.Tensor:
    """The sort-free cuts in ATen ops (any device): the CPU path and the Triton kernels' oracle."""
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logits = logits / temp[:, None]  # [N, V]
    vocab = logits.shape[-1]
    keys = _ordered_keys(logits)  # [N, V] int32
    # Top-k: exactly k tokens (k = V when off); among tokens equal to the k-th value the first ones by index.
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))[:, None]
    t_k = _threshold_key(keys, None, k)
    above, ties = keys > t_k, keys == t_k
    in_k = above | ties & (_first_ties(ties) <= k - above.sum(-1, keepdim=True))
    probs = logits.masked_fill(~in_k, float("-inf")).softmax(-1)  # [N, V], 0 outside the top k
    # Top-p: the smallest set of the likeliest tokens whose mass reaches top_p; the last one's key is the
    # largest t with mass(keys >= t) >= top_p. Equal tokens there: kept while the mass before stays < top_p.
    t_p = _threshold_key(keys, probs, top_p[:, None])
    above = (keys > t_p) & in_k
    mass_above = torch.where(above, probs, 0.0).sum(-1, keepdim=True)
    ties = (keys == t_p) & in_k
    rank = _first_ties(ties)
    tie_prob = torch.where(ties, probs, 0.0).amax(-1, keepdim=True)  # equal logits: equal probabilities
    keep_tie = ties & ((rank == 1) | (mass_above + (rank - 1) * tie_prob < top_p[:, None]))
    keep = torch.where(top_p[:, None] < 1.0, above | keep_tie, in_k)
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, greedy_argmax(logits)[:, None], 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


# Registering the op is this module's one import-time action (once per process, before any graph naming it
# is traced or loaded from artifacts).
@custom_op("draftgraph::sampling_probs", mutates_args=())
def _sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    return _probabilities(logits, temperature, top_k, top_p)


@_sampling_probs.register_fake
def _(logits, temperature, top_k, top_p):
    return logits.new_empty(logits.shape, dtype=torch.float32)
