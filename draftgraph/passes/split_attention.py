"""Split a Dynamo graph at the attention custom op into typed pieces.

Policy here, surgery by torch.fx: each node gets a piece number (the attention node alone in its own
piece), then `split_module(keep_original_order=True)` builds the submodules. Source order matters: the
KV-cache writes are side effects that FX data dependencies do not see.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from draftgraph.ops.splitting import SPLITTING_OPS


def splitting_targets() -> set:
    """The op packets and overloads to split at (Dynamo records packets; later stages overloads)."""
    targets = set()
    for qualname in SPLITTING_OPS:
        ns, name = qualname.split("::")
        packet = getattr(getattr(torch.ops, ns), name)
        targets.add(packet)
        targets.update(getattr(packet, o) for o in packet.overloads())
    return targets


def is_split_node(node: fx.Node, targets: set) -> bool:
    return node.op == "call_function" and node.target in targets


@dataclass(frozen=True)
class Piece:
    """One submodule of the split graph."""

    index: int
    name: str  # the submodule's attribute name in the split graph ("submod_N")
    is_attention: bool  # a split-op piece (attention, or a piece boundary): runs as is, never compiled
    graph: fx.GraphModule
    key: str  # structural hash: identical layers share a key (and one compiled artifact)


@dataclass(frozen=True)
class SplitGraph:
    module: fx.GraphModule  # calls the pieces in order
    pieces: tuple[Piece, ...]

    @property
    def compute_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if not p.is_attention)

    @property
    def unique_keys(self) -> list[str]:
        return list(dict.fromkeys(p.key for p in self.compute_pieces))


def token_symbol(gm: fx.GraphModule):
    """The symbol of the token dimension: dim 0 of `input_ids` (else the first symbolic dim 0)."""
    candidates = []
    for node in gm.graph.nodes:
        ev = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(ev, torch.Tensor) and ev.dim() and isinstance(ev.shape[0], torch.SymInt):
            candidates.append((0 if "input_ids" in node.name else 1, ev.shape[0].node.expr))
    if not candidates:
        raise ValueError("the traced graph has no symbolic token dimension; were the batch dims marked?")
    return min(candidates, key=lambda c: c[0])[1]


def split_at_attention(gm: fx.GraphModule) -> SplitGraph:
    targets = splitting_targets()
    part, assignment, attention_parts = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node, targets):
            part += 1
            assignment[node] = part
            attention_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    split = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        index = int(node.target.split("_")[-1])
        pieces.append(Piece(index, node.target, index in attention_parts, sub, structural_key(sub)))
    return SplitGraph(split, tuple(pieces))


def structural_key(gm: fx.GraphModule) -> str:
    """Hash of a graph's structure with names removed: ops, targets, argument wiring, input shapes and
    strides. Symbols are renamed by first appearance, so identical pieces of different traces (a target and
    the draft model truncated from it; the drafter inside the fused loop) share one key and one compile.
    (Whether a piece's graphs are keyed by the token count is decided per use: piece_runner.py.)"""
    import sympy  # here: a quarter second to import, never needed by an engine of mode NONE

    ids, names = {}, {}

    def sym(d) -> str:
        if not isinstance(d, torch.SymInt):
            return str(int(d))
        expr = d.node.expr
        sub = {}
        for s in sorted(expr.free_symbols, key=str):
            if s not in names:
                names[s] = f"s{len(names)}"
            sub[s] = names[s]
        return str(expr.xreplace({s: sympy.Symbol(n) for s, n in sub.items()}))

    lines = []
    for i, node in enumerate(gm.graph.nodes):
        ids[node] = f"%{i}"
        ev = node.meta.get("example_value")
        meta = ""
        if isinstance(ev, torch.Tensor):
            shape = tuple(sym(d) for d in ev.shape)
            stride = tuple(sym(d) for d in ev.stride()) if ev.layout == torch.strided else ()
            meta = f"{shape}:{stride}:{ev.dtype}:{ev.device.type}"
        elif isinstance(ev, torch.SymInt):
            meta = f"SymInt:{sym(ev)}"
        elif ev is not None:
            meta = type(ev).__name__
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: ids[n])
        target = node.target if node.op != "placeholder" else "input"
        lines.append(f"{node.op}|{_target_name(target)}|{args}|{meta}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:20]


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
