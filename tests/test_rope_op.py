"""The fused RoPE op (ops/rope): on the CPU it is the rotation models/rope.py always ran (and v made contiguous);
the Triton kernel (interpreter here, CUDA on the device) gives the same values from the strided views of a fused
QKV output, GQA and MHA head counts; it compiles for sm_90; the Llama attention keeps its values; bad shapes name
the fix."""

import pytest
import torch

from draftgraph.models.rope import apply_rope
from draftgraph.ops.rope.op import kernel_takes, rope_qkv, rotate_half
from draftgraph.ops.rope.triton_rope import _rope_qkv_kernel, rope_qkv_triton
from tests.helpers import compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv_views(t, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    pos = torch.randint(0, 4096, (t,), generator=g).float()
    freqs = pos[:, None] / (10000.0 ** (torch.arange(d // 2) * 2.0 / d))[None, :]
    cs = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)
    cos, sin = cs.chunk(2, dim=-1)  # [T, D/2] views with a row stride of D, as rope_lookup gives
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)])
def test_kernel_equals_the_reference(dtype, heads):
    q, k, v, cos, sin = qkv_views(5, *heads, 16, dtype)
    got = rope_qkv_triton(q, k, v, cos, sin)
    want = (rotate_half(q, cos, sin), rotate_half(k, cos, sin), v.contiguous())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # a bf16 ulp
    for g_, w_ in zip(got, want):
        assert g_.is_contiguous() and g_.dtype == dtype and g_.shape == w_.shape
        torch.testing.assert_close(g_, w_, **tol)
    assert torch.equal(got[2], v.contiguous())  # v is copied exactly


def test_cpu_op_is_the_models_rotation():
    q, k, v, cos, sin = (x.cpu() for x in qkv_views(3, 4, 2, 16, torch.bfloat16, seed=1))
    rq, rk, rv = rope_qkv(q, k, v, cos, sin)
    assert torch.equal(rq, apply_rope(q, cos, sin)) and torch.equal(rk, apply_rope(k, cos, sin))
    assert torch.equal(rv, v) and rv.is_contiguous()
    torch.library.opcheck(torch.ops.draftgraph.rope_qkv.default, (q, k, v, cos, sin))


def test_no_tokens_and_the_head_sizes_taken():
    q, k, v, cos, sin = qkv_views(0, 2, 1, 16, torch.float32)
    assert all(x.shape[0] == 0 for x in rope_qkv_triton(q, k, v, cos, sin))
    assert kernel_takes(64) and kernel_takes(128) and not kernel_takes(80) and not kernel_takes(96)


def test_kernel_compiles_for_a_hopper_gpu():
    sig = {n: "*bf16" for n in ("q", "k", "v", "q_out", "k_out", "v_out")}
    sig.update({"cos": "*fp32", "sin": "*fp32", "HQ": "i32", "HKV": "i32"})
    sig.update({n: "i64" for n in ("sqt", "sqh", "skt", "skh", "svt", "svh", "sct", "sst")})
    got = compile_for_sm90(_rope_qkv_kernel, sig, {"HALF": 64})
    assert got is None or "cubin" in got


def test_bad_shapes_name_the_fix():
    q, k, v, cos, sin = qkv_views(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cos and sin \\[T, D/2\\]"):
        torch.ops.draftgraph.rope_qkv(q.to("meta"), k.to("meta"), v.to("meta"), cos[:, :4].to("meta"), sin.to("meta"))
    bad = torch.zeros(3, 2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="twice a power of two"):
        rope_qkv_triton(bad, bad, bad, torch.zeros(3, 6, device=DEVICE), torch.zeros(3, 6, device=DEVICE))
