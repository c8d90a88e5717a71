"""A post-grad Inductor pass: a residual add stays an add (`mm` + `add`), not a cuBLAS `addmm`.

Inductor rewrites `residual + x @ w` into `addmm(residual, x, w)` whenever the sum has a use that is not
pointwise (here: the piece's output, the residual the next layer reads). On the GPU that costs a copy of the
residual into the output buffer (one kernel) before cuBLAS adds in place, twice per decoder layer (o_proj and
down_proj): at one decode token those copies are 1 us kernels plus their launch gaps inside the graph
(docs/history/benchmarks-2026-11.md, 2026-11-23: 30 memcpy kernels per plain step of the 1B-shaped target).
Kept as `mm` + `add`, the add can fuse into the kernel that follows (the next RMSNorm reads the sum anyway), and
it rounds as eager PyTorch and transformers do: the product to the model's dtype, then the add. Measured
(docs/history/benchmarks-2026-11.md, 2026-11-26): the 1B-shaped pair's plain decode step at batch 1 6 % faster
in two runs on two machines; the other batch sizes and the speculative step moved both ways within run-to-run
spread. Kernel by kernel (plain, batch 1): 281 kernels with it against 266 without, GPU time within 0.9 %.

Only full-size addends on CUDA tensors with alpha = beta = 1 are unfused: a broadcast bias (a [N] row) keeps
cuBLAS's fused epilogue, and CPU code keeps Inductor's choice. Installed for every piece by
`compiler.inductor_options.inductor_patch` as Inductor's `post_grad_custom_post_pass` (a `CustomGraphPass`, so
its uuid, a hash of this file, enters Inductor's cache keys); `OpChoices(unfuse_addmm=False)` leaves it out, for
comparisons.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def unfuse_residual_addmm(graph: torch.fx.Graph) -> int:
    """Rewrite each qualifying `addmm(inp, a, b)` into `add(inp, mm(a, b))`; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            continue
        inp, a, b = node.args
        out, addend = _val(node), _val(inp)
        if not isinstance(out, torch.Tensor) or not isinstance(addend, torch.Tensor):
            continue
        if out.device.type != "cuda" or addend.dim() != 2 or addend.shape != out.shape:
            continue  # a broadcast bias keeps the fused epilogue; the CPU keeps Inductor's choice
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            mode = getattr(out, "fake_mode", None)
            with mode if mode is not None else contextlib.nullcontext():
                mm.meta["val"] = out.new_empty_strided(out.shape, out.stride())
            add = graph.call_function(aten.add.Tensor, (inp, mm))
            add.meta["val"] = out
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    return count


class UnfuseResidualAddmm(CustomGraphPass):
    """`unfuse_residual_addmm` as Inductor's post-grad custom pass."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        unfuse_residual_addmm(graph)

    def uuid(self) -> str:
        return _source_hash()


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
