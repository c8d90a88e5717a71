"""A uniform batch's metadata built on the device (ops/attention/uniform_metadata.py): the torch reference
against the host builder (runtime/attn_metadata.py) on the same requests, and the Triton kernel (under the
interpreter here; on CUDA in tests/gpu/test_advance_cuda.py) against the reference, padding rows included."""

import pytest
import torch

from draftgraph.ops.attention.metadata import META_FIELDS
from draftgraph.ops.attention.uniform_metadata import uniform_metadata_kernel, uniform_metadata_reference
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from tests.helpers import compile_for_sm90

BS, W = 4, 6


def batch(n_valid: int, b: int, q: int, seed: int = 0):
    """Per-slot tables (slot 7 the scratch row), n_valid requests at random slots and lengths, padded to b."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(1, 50, (8, W), generator=g, dtype=torch.int32)
    tables[7] = 0
    slots = torch.randperm(7, generator=g)[:n_valid].tolist()
    lengths = torch.randint(0, W * BS - q + 1, (n_valid,), generator=g).tolist()
    pad = b - n_valid
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return tables, t(slots + [7] * pad), t(lengths + [0] * pad), t([1] * n_valid + [0] * pad), slots, lengths


@pytest.mark.parametrize("q", [1, 4, 5])
def test_reference_equals_the_host_builder(q):
    tables, slots, lengths, valid, real_slots, real_lengths = batch(3, 3, q)
    pos, meta = uniform_metadata_reference(tables, slots, lengths, valid, q, BS)
    builder = MetadataBuilder(64, 8, W, BS, "cpu")
    reqs = [RequestSlice(tables[s].tolist(), n, q) for s, n in zip(real_slots, real_lengths)]
    want, want_pos = builder.build(reqs)
    assert torch.equal(pos, want_pos)
    for f in META_FIELDS:
        assert torch.equal(getattr(meta, f), getattr(want, f)), f


@pytest.mark.parametrize("q,n_valid,b", [(1, 1, 1), (5, 2, 4), (4, 3, 8), (2, 0, 2)])
def test_kernel_equals_the_reference_with_padding(q, n_valid, b):
    tables, slots, lengths, valid, _, _ = batch(n_valid, b, q, seed=q + b)
    pos, meta = uniform_metadata_reference(tables, slots, lengths, valid, q, BS)
    got = uniform_metadata_kernel(tables, slots, lengths, valid, q, BS)
    want = (pos, meta.slot_mapping, meta.token_req, meta.token_kv_len, meta.block_tables, meta.seq_lens,
            meta.query_start_loc)  # fmt: skip
    for name, a, w in zip(("positions", *META_FIELDS[:3], "block_tables", "seq_lens", "qsl"), got, want):
        assert a.dtype == w.dtype and torch.equal(a, w), name
    pad = valid == 0
    assert (meta.slot_mapping.view(b, q)[pad] == -1).all() and (meta.token_kv_len.view(b, q)[pad] == 0).all()
    assert (meta.seq_lens[pad] == 0).all()


def test_kernel_compiles_for_a_hopper_gpu():
    """The interpreter runs what Triton's compiler refuses (a name with another type in each branch of an if):
    compile the kernel for sm_90 here, no GPU needed, as the device would at its first launch."""
    from draftgraph.ops.attention.uniform_metadata import BLOCK, BLOCK_W, _uniform_kernel

    ptr = {"tables": "*i32", "slots": "*i64", "lengths": "*i64", "valid": "*i64", "pos_out": "*i64",
           "slot_out": "*i64", "req_out": "*i32", "kv_out": "*i32", "rows_out": "*i32", "seq_out": "*i32",
           "qsl_out": "*i32"}  # fmt: skip
    compiled = compile_for_sm90(_uniform_kernel, {**ptr, "stride_t": "i64", "B": "i32", "W": "i32"},
                                {"Q": 5, "BLOCK_SIZE": 16, "BLOCK": BLOCK, "BLOCK_W": BLOCK_W})  # fmt: skip
    assert "cubin" in compiled
