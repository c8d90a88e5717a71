"""torch.compile of the target forward and the drafter step through the piecewise backend.

Every call marks the batch dimensions as unbacked (token dim "tokens", request dim "reqs"), so the one
Dynamo trace has no size guards and no 0/1 specialization: changing the batch size never re-traces.
Marks go on the tensors actually passed (each call builds fresh views), which is what Dynamo reads.
"""

from __future__ import annotations

import itertools
import types

import torch

from draftgraph.compiler.piecewise import PiecewiseBackend
from draftgraph.ops.attention.metadata import META_FIELDS, AttentionMetadata
from draftgraph.ops.splitting import mark_piece_boundary


def mark_batch_dims(input_ids, positions, meta: AttentionMetadata, hidden=None) -> None:
    mark_unbacked = _mark_unbacked()
    for t in (input_ids, positions, meta.slot_mapping, meta.token_req, meta.token_kv_len, hidden):
        if t is not None:
            mark_unbacked(t, 0, shape_id="tokens")
    mark_unbacked(meta.block_tables, 0, shape_id="reqs")
    mark_unbacked(meta.seq_lens, 0, shape_id="reqs")
    mark_unbacked(meta.query_start_loc, 0, shape_id="reqs_plus_one")


_serial = itertools.count()


def _tensor_inputs(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, AttentionMetadata):
            out += [getattr(a, f) for f in META_FIELDS]
    return out


def own_entry_point(fn, name: str):
    """A call-through to `fn` with a code object of its own. Dynamo caches compiled code per code
    object, so compiling `model.forward` directly would pile every engine's entries onto the one
    `forward` code object (hitting the recompile limit after 8 engines); this entry point's cache
    entries belong to one engine and are freed with it."""

    def entry(*args, **kwargs):
        # A split point before the function body: the batch-dim checks Dynamo adds at the inputs land in a
        # piece of their own, so the body's pieces are the same as where the body is traced inside another
        # function (the drafter inside the fused draft loop) and share its compiled code.
        mark_piece_boundary(*_tensor_inputs(args))
        return fn(*args, **kwargs)

    code = entry.__code__.replace(co_name=f"{name}_{next(_serial)}")
    return types.FunctionType(code, entry.__globals__, code.co_name, None, entry.__closure__)


class LazyCompile:
    """`torch.compile(own_entry_point(fn, name), backend=backend, fullgraph=True, dynamic=False)`, made at the
    first call: an engine that loads artifacts never calls it, and its first torch.compile imports Dynamo's
    backend registry (functorch's partitioners, networkx: 1.1 s of a 6.5 s warm start on an H100,
    docs/history/benchmarks-2026-11.md, 2026-11-23)."""

    def __init__(self, fn, name: str, backend: PiecewiseBackend):
        self.target, self.name, self.backend = fn, name, backend
        self.compiled = None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            entry = own_entry_point(self.target, self.name)
            self.compiled = torch.compile(entry, backend=self.backend, fullgraph=True, dynamic=False)
        return self.compiled(*args, **kwargs)


class CompiledTarget:
    """Calls like CausalLM.forward(input_ids, positions, meta, kv_caches, aux_layers)."""

    def __init__(self, model, backend: PiecewiseBackend):
        self.model, self.backend = model, backend
        self.fn = LazyCompile(model.forward, "target", backend)

    @torch.no_grad()  # grad mode is a Dynamo guard: inference always runs without it
    def __call__(self, input_ids, positions, meta, kv_caches, aux_layers=()):
        mark_batch_dims(input_ids, positions, meta)
        return self.fn(input_ids, positions, meta, kv_caches, aux_layers)


class CompiledDrafter:
    """Calls like Drafter.forward(input_ids, positions, hidden, meta, kv_caches)."""

    def __init__(self, drafter, backend: PiecewiseBackend):
        self.drafter, self.backend = drafter, backend
        self.fn = LazyCompile(drafter.forward, "drafter", backend)

    @torch.no_grad()
    def __call__(self, input_ids, positions, hidden, meta, kv_caches):
        mark_batch_dims(input_ids, positions, meta, hidden)
        return self.fn(input_ids, positions, hidden, meta, kv_caches)


_TOKEN_ARGS = ("input_ids", "positions", "hidden", "slot_mapping", "token_req", "token_kv_len")
_REQ_ARGS = ("block_tables", "seq_lens", "sample_rows", "valid", "slots", "temperature", "top_k", "top_p", "seeds")


class CompiledLoop:
    """The fused draft loop (runtime/drafting.py) traced once by Dynamo: all K drafter forwards, the
    token choices and the on-device advance in one graph, split at attention like any other function.
    Called with the loop's keyword arguments; batch dims are unbacked as for the forwards."""

    def __init__(self, loop_fn, name: str, backend: PiecewiseBackend):
        self.backend, self.loop_fn = backend, loop_fn
        self.fn = LazyCompile(loop_fn, name, backend)

    @torch.no_grad()
    def __call__(self, **kw):
        mark_unbacked = _mark_unbacked()
        for name in _TOKEN_ARGS:
            if kw.get(name) is not None:
                mark_unbacked(kw[name], 0, shape_id="tokens")
        for name in _REQ_ARGS:
            if kw.get(name) is not None:
                mark_unbacked(kw[name], 0, shape_id="reqs")
        mark_unbacked(kw["query_start_loc"], 0, shape_id="reqs_plus_one")
        return self.fn(**kw)


def _mark_unbacked():
    """Dynamo's mark_unbacked, imported at the first compiled call: an engine that compiles nothing (mode NONE)
    never imports Dynamo (a second of a CPU start)."""
    from torch._dynamo.decorators import mark_unbacked

    return mark_unbacked
