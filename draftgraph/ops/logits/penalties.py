"""Logits processing per request: logit_bias, min_tokens, repetition / presence / frequency penalties, over
logits [B, R, V] whose row i of a request comes after drafts 0..first_row+i-1 (runtime/penalties.py keeps the
tables): the verify's rows (first_row 0, drafts [B, R - 1]) or a draft step's one row (first_row j, the j drafts
proposed before it).

In vLLM's order: the bias is added, stop tokens get -inf while fewer than min_tokens tokens are generated, then
the repetition penalty over seen tokens (in the prompt or counted: a logit > 0 is divided by it, else multiplied),
then logit -= frequency * count + presence * (count > 0). Rows of inactive slots keep their raw logits bit for bit.

`process_logits` picks the implementation: on CUDA with `kernel` (OpChoices.logits_kernels) the Triton kernels
(triton_penalties.py: one read and one write of the logits, then the few bias and draft columns again), elsewhere
`process_reference`, the torch ops (the CPU path and the kernels' oracle). Neither reads anything back to the host:
both sit inside CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_LOGIT_BIAS = 300  # (id, bias) pairs a request may give: OpenAI's limit; a fixed width of the device table
PROMPT, STOP = 1, 2  # flag bits per vocabulary entry: in the prompt (repetition penalty), a stop token (min_tokens)


class PenaltyTables(NamedTuple):
    """Per request slot device tables (slots rows): what the processing of a slot's rows reads."""

    counts: torch.Tensor  # [slots, V] int32: output tokens so far
    flags: torch.Tensor  # [slots, V] uint8: PROMPT | STOP bits
    repetition: torch.Tensor  # [slots] float32
    presence: torch.Tensor  # [slots] float32
    frequency: torch.Tensor  # [slots] float32
    min_tokens: torch.Tensor  # [slots] int64
    generated: torch.Tensor  # [slots] int64: output length so far
    bias_ids: torch.Tensor  # [slots, MAX_LOGIT_BIAS] int64 (distinct ids; padding pairs (0, 0.0))
    bias_vals: torch.Tensor  # [slots, MAX_LOGIT_BIAS] float32
    active: torch.Tensor  # [slots] bool: the slot's request asks for processing


def process_logits(
    logits: torch.Tensor,
    slots: torch.Tensor,
    drafts: torch.Tensor | None,
    t: PenaltyTables,
    kernel: bool,
    first_row: int = 0,
) -> torch.Tensor:
    """Processed logits [B, R, V] (logits' dtype) for logits [B, R, V] of the requests in slots [B], row i coming
    after the slot's output and drafts[:, :first_row + i] (drafts [B, K], or None: no drafts)."""
    if kernel and logits.is_cuda:
        from draftgraph.ops.logits.triton_penalties import process_triton  # Triton loads on first use

        return process_triton(logits, slots, drafts, t, first_row)
    return process_reference(logits, slots, drafts, t, first_row)


def process_reference(
    logits: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor | None, t: PenaltyTables, first_row: int = 0
) -> torch.Tensor:
    """The torch ops. Every row is processed with the slot's counts ([B, 1, V], broadcast); then the only entries
    whose count differs between a request's rows, the K draft columns, are processed again with row i's counts
    there (the slot's plus the drafts before i equal to that column) and written over: [B, R, K] values, not a
    [B, R, V] count tensor per step."""
    b, r, v = logits.shape
    counts, flags = t.counts[slots], t.flags[slots]  # [B, V]
    bias = torch.zeros(b, v, dtype=torch.float32, device=logits.device)
    bias.scatter_add_(-1, t.bias_ids[slots], t.bias_vals[slots])  # absent pairs add 0 to token 0
    generated = t.generated[slots][:, None] + first_row + torch.arange(r, device=logits.device)[None, :]  # [B, R]
    too_early = (generated < t.min_tokens[slots][:, None])[..., None]  # [B, R, 1]
    rep, freq, pres = (x[slots][:, None, None] for x in (t.repetition, t.frequency, t.presence))
    x = _processed(logits.float(), counts[:, None], flags[:, None], bias[:, None], too_early, rep, freq, pres)
    if drafts is not None and drafts.shape[1]:  # row i also counts drafts before it: only their columns change
        k = drafts.shape[1]
        cols = drafts.long()  # [B, K]
        at = cols[:, None, :].expand(b, r, k)  # [B, R, K]: row i, draft column j
        same = cols[:, :, None] == cols[:, None, :]  # [B, K (j'), K (j)]: draft j' is the token of column j
        ar = first_row + torch.arange(r, device=logits.device)
        before = (torch.arange(k, device=logits.device)[None, :] < ar[:, None])[None, :, :, None]  # j' < first + i
        extra = (before & same[:, None]).sum(2, dtype=torch.int32)  # [B, R, K]
        fixed = _processed(
            logits.gather(-1, at).float(), counts.gather(-1, cols)[:, None, :] + extra,
            flags.gather(-1, cols)[:, None, :], bias.gather(-1, cols)[:, None, :], too_early, rep, freq, pres,
        )  # fmt: skip
        x = x.scatter(-1, at, fixed)  # a column drafted twice gets the same value from both
    return torch.where(t.active[slots][:, None, None], x.to(logits.dtype), logits)


def _processed(x, counts, flags, bias, too_early, rep, freq, pres):
    """The processing of the module docstring's order on logits x (float32) with counts, flags and bias broadcast
    to it: bias; -inf on stop tokens while too early; repetition over seen tokens; frequency and presence."""
    x = (x + bias).masked_fill(too_early & ((flags & STOP) != 0), float("-inf"))
    seen = (counts > 0) | ((flags & PROMPT) != 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)
