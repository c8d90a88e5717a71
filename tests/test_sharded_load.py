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
