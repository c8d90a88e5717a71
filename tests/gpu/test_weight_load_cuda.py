"""Checkpoints read straight onto the GPU (models/mapped_read.py: memory-mapped views, one copy into pinned
buffers, then to the device) equal the CPU read, tensor for tensor: a whole target and draft model, each
tensor-parallel rank's share (row- and column-parallel cuts, fused q/k/v and gate/up), and the loader's chunks
when its buffers hold only a few rows (the copies queued on the stream while the next buffer fills)."""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.mapped_read import DeviceLoader, MappedSafetensors
from draftgraph.ops.collectives.op import ParallelGroup
from tests.helpers import tiny_hf_model

SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    tiny_hf_model("llama", seed=1, **SHAPE).save_pretrained(root / "target", max_shard_size="40KB")
    tiny_hf_model("llama", seed=2, num_hidden_layers=1, **SHAPE).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    got, want = a.state_dict(), b.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == "cuda", k
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].cpu(), want[k]), k


@pytest.mark.parametrize("tp", [ParallelGroup.single(), ParallelGroup(0, 2, "unused"), ParallelGroup(1, 2, "unused")])
def test_a_checkpoint_read_onto_the_gpu_equals_the_cpu_read(checkpoints, tp):
    target, drafter = checkpoints
    for dtype in (torch.float32, torch.bfloat16):
        cpu = CausalLM.from_pretrained(target, dtype=dtype, device="cpu", tp=tp)
        gpu = CausalLM.from_pretrained(target, dtype=dtype, device="cuda", tp=tp)
        _same(gpu, cpu)
        cpu_draft = load_drafter(drafter, cpu, device=torch.device("cpu"), tp=tp)
        gpu_draft = load_drafter(drafter, gpu, device=torch.device("cuda"), tp=tp)
        _same(gpu_draft.model, cpu_draft.model)


def test_the_loader_in_chunks_of_a_few_rows(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g).bfloat16()
    save_file({"w": w, "v": torch.randn(1000, generator=g)}, str(tmp_path / "w.safetensors"))
    with MappedSafetensors(str(tmp_path / "w.safetensors")) as h:
        loader = DeviceLoader(torch.device("cuda"), stage_bytes=4096)  # 21 rows of w a chunk, 2 buffers in turn
        cols = loader.load([h.get_slice("w")[:, 0:16], h.get_slice("w")[:, 48:80]], dim=1)
        rows = loader.load([h.get_slice("w")[7:150]])
        vec = loader.load([h.get_tensor("v")])
        loader.close()
        assert torch.equal(cols.cpu(), torch.cat([w[:, 0:16], w[:, 48:80]], 1))
        assert torch.equal(rows.cpu(), w[7:150]) and torch.equal(vec.cpu(), h.get_tensor("v"))
        assert cols.is_contiguous() and loader.copied_bytes == (300 * 48 + 143 * 96) * 2 + 1000 * 4
