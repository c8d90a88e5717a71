"""Sharded checkpoint reads: with tensor parallelism each rank reads only its slices of the split tensors.

A tiny Llama (biases everywhere, untied head) saved with save_pretrained in several safetensors shards (an
index); two gloo ranks (tests/test_tensor_parallel.py's harness) each load it with every read going through a
recording wrapper of safetensors: a whole-tensor read of a split tensor fails the rank, and the bytes read are
exactly the replicated tensors plus 1/W of the split ones. The share equals the whole-then-sliced one tensor
for tensor, and its greedy tokens equal the one-process engine's.
"""

from contextlib import contextmanager

import pytest
import torch

import draftgraph as dg
import draftgraph.models.parallel.sharded_read as sharded_read
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.parallel.dense import shard_dim
from draftgraph.models.weights import read_checkpoint, read_target_config, weight_files
from draftgraph.ops.collectives.op import ParallelGroup
from tests.helpers import tiny_hf_model
from tests.test_tensor_parallel import spawn

SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
PROMPTS = [[1, 5, 9, 3], [7, 7], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "llama"
    tiny_hf_model("llama", **SHAPE).save_pretrained(path, max_shard_size="40KB")
    assert len(weight_files(str(path))) > 1  # an index over several files
    return str(path)


class Recording:
    """A safe_open handle that records (name, bytes, whole) for every read and refuses whole reads of the
    tensors `split(name)` says are cut."""

    def __init__(self, handle, log, split):
        self.handle, self.log, self.split = handle, log, split

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        if self.split(name):
            raise AssertionError(f"{name} is split over ranks but was read whole")
        t = self.handle.get_tensor(name)
        self.log.append((name, t.nbytes, True))
        return t

    def get_slice(self, name):
        part, log = self.handle.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return part.get_shape()

            def __getitem__(self, index):
                t = part[index]
                log.append((name, t.nbytes, False))
                return t

        return Slice()


@contextmanager
def recorded_reads(log: list, split):
    """Every safetensors read of draftgraph's sharded loads recorded into `log` (see Recording)."""
    real = sharded_read.safe_open
    sharded_read.safe_open = lambda file: Recording(real(file), log, split)
    try:
        yield
    finally:
        sharded_read.safe_open = real


def _load_and_generate(tp: ParallelGroup, path: str):
    log = []
    with recorded_reads(log, lambda name: shard_dim(name) is not None):
        shard = CausalLM.from_pretrained(path, tp=tp)
    whole = read_checkpoint(path)
    split = {k for k in whole if shard_dim(k) is not None}
    assert split and {name for name, _, full in log if not full} == split  # every split tensor sliced
    assert {name for name, _, full in log if full} == whole.keys() - split  # the rest read whole, once
    want_bytes = sum(t.nbytes for k, t in whole.items() if k not in split)
    want_bytes += sum(whole[k].nbytes for k in split) // tp.world_size
    assert sum(n for _, n, _ in log) == want_bytes < sum(t.nbytes for t in whole.values())

    # the same share as reading everything and slicing it (the transformers-object path)
    ref = CausalLM.from_state_dict(ModelConfig.from_hf(read_target_config(path)), whole, tp=tp)
    got, want = shard.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    config = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32)
    params = dg.SamplingParams(max_tokens=6, ignore_eos=True)
    one = dg.compile_model(CausalLM.from_pretrained(path), config=config).generate(PROMPTS, params)
    split_out = dg.compile_model(shard, config=config).generate(PROMPTS, params)
    assert [o.token_ids for o in split_out] == [o.token_ids for o in one]


def test_each_rank_reads_only_its_slices(checkpoint, tmp_path):
    spawn(_load_and_generate, 2, tmp_path, checkpoint)


def test_a_size_tp_cannot_split_is_refused_before_reading(checkpoint, monkeypatch):
    def no_reads(file):
        raise AssertionError(f"{file} was opened")

    monkeypatch.setattr(sharded_read, "safe_open", no_reads)
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide num_attention_heads=8"):
        CausalLM.from_pretrained(checkpoint, tp=ParallelGroup(0, 3, "unused"))


def _raw_safetensors(path, entries: dict, data: bytes) -> None:
    """A safetensors file written by hand (entries: name -> (dtype, shape, begin, end)), so its offsets can be
    what safetensors' own writer never makes (unaligned)."""
    import json
    import struct

    header = json.dumps({k: {"dtype": d, "shape": s, "data_offsets": [b, e]} for k, (d, s, b, e) in entries.items()})
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_the_mapped_reader_reads_what_safetensors_reads(tmp_path):
    """models/mapped_read.py: every dtype, a scalar, an empty tensor; slices are views; an unaligned tensor is
    still read; a truncated file is named; the loader's chunks (a buffer of a few rows) build the same tensors,
    a share of several column ranges included."""
    from safetensors.torch import load_file, save_file

    from draftgraph.models.mapped_read import DeviceLoader, MappedSafetensors

    g = torch.Generator().manual_seed(0)
    state = {
        "bf16": torch.randn(37, 11, generator=g).bfloat16(), "f32": torch.randn(5, 3, 2, generator=g),
        "f16": torch.randn(9, generator=g).half(), "i64": torch.arange(7), "i8": torch.arange(-3, 4).to(torch.int8),
        "u8": torch.arange(5).to(torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
    }  # fmt: skip
    file = tmp_path / "m.safetensors"
    save_file(state, str(file))
    want = load_file(str(file))
    with MappedSafetensors(str(file)) as h:
        assert sorted(h.keys()) == sorted(state)
        for name, t in want.items():
            got = h.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        part = h.get_slice("bf16")[:, 3:7]
        assert h.get_slice("bf16").get_shape() == [37, 11] and torch.equal(part, want["bf16"][:, 3:7])
        assert part.data_ptr() == h.get_tensor("bf16")[:, 3:].data_ptr()  # a view of the map, not a copy
        loader = DeviceLoader(torch.device("cpu"), stage_bytes=64, pin=False)  # 64 bytes: a few rows a chunk
        for name, t in want.items():
            assert torch.equal(loader.load([h.get_tensor(name)]), t), name
        cols = [h.get_slice("bf16")[:, 0:2], h.get_slice("bf16")[:, 5:9]]
        assert torch.equal(loader.load(cols, dim=1), torch.cat([want["bf16"][:, 0:2], want["bf16"][:, 5:9]], 1))
        rows = [h.get_slice("f32")[0:2], h.get_slice("f32")[3:5]]
        assert torch.equal(loader.load(rows, dim=0), torch.cat([want["f32"][0:2], want["f32"][3:5]]))
        assert loader.copied_bytes > 0
        loader.close()

    odd = tmp_path / "odd.safetensors"  # a 3-byte tensor first: the bf16 one after it starts at an odd byte
    values = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    data = b"\x01\x02\x03" + values.view(torch.uint8).numpy().tobytes()
    _raw_safetensors(odd, {"u": ("U8", [3], 0, 3), "b": ("BF16", [2], 3, 7)}, data)
    with MappedSafetensors(str(odd)) as h:
        assert torch.equal(h.get_tensor("b"), values) and h.get_tensor("u").tolist() == [1, 2, 3]

    cut = tmp_path / "cut.safetensors"
    _raw_safetensors(cut, {"w": ("F32", [4, 4], 0, 64)}, bytes(32))
    with pytest.raises(ValueError, match=r"'w' \(F32 \[4, 4\]\) claims bytes \[0, 64\) of the 32 data bytes"):
        MappedSafetensors(str(cut))
    _raw_safetensors(cut, {"w": ("F4", [2], 0, 1)}, bytes(1))
    with pytest.raises(ValueError, match=r"'w' has dtype 'F4', which this torch cannot hold \(known: \['BF16'"):
        MappedSafetensors(str(cut))
