"""The models' linear layers: F.linear, or on CUDA `draftgraph::linear` (a Triton GEMV for a few rows, cuBLAS
for more: ops/linear/op.py). The choice is made per call from the input's device, so a trace on the CPU names
aten's matmul as before and a trace on CUDA names the op; `OpChoices(gemv=False)` keeps F.linear everywhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import draftgraph.ops.linear.op  # noqa: F401  (registers torch.ops.draftgraph.linear)
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ops: OpChoices) -> torch.Tensor:
    """x @ weight.T + bias."""
    if x.is_cuda and ops.gemv:
        return torch.ops.draftgraph.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, ops: OpChoices) -> torch.Tensor:
    """An LM head's logits, hidden @ weight.T (as the heads always wrote it off CUDA)."""
    if hidden.is_cuda and ops.gemv:
        return torch.ops.draftgraph.linear(hidden, weight, None)
    return hidden @ weight.t()


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose product is `project` under `ops`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, ops: OpChoices = DEFAULT_OPS):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.ops)
