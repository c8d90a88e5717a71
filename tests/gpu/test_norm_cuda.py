"""GPU tier: the RMSNorm kernel (ops/norm/triton_rms_norm.py) on CUDA against the torch reference at model sizes:
the residual stream exact in bf16, the norm within one bf16 step of eager torch (the sum of squares in another
order), and from a CUDA graph."""

import pytest
import torch

from draftgraph.ops.norm.op import rms_norm_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,hidden", [(1, 2048), (5, 2048), (64, 4096), (3, 7168), (2, 128)])
def test_kernel_against_eager_torch(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, hidden, generator=g).bfloat16().cuda() for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16().cuda()
    s, y = torch.ops.draftgraph.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    want = rms_norm_reference(x + r, w, 1e-5)
    torch.testing.assert_close(y, want, rtol=8e-3, atol=8e-3)
    assert (y != want).float().mean() < 0.02  # a few elements one bf16 step apart, not a different norm
    torch.testing.assert_close(torch.ops.draftgraph.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5),
                               rtol=8e-3, atol=8e-3)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gs, gy = torch.ops.draftgraph.add_rms_norm(x, r, w, 1e-5)
    x.mul_(2)
    graph.replay()
    assert torch.equal(gs, x + r)
