"""`draftgraph::add_rms_norm_qkv_rope_write` (ops/linear/op.py) and its one-row kernel (ops/linear/triton_qkv.py): the
input norm, the QKV projection, RoPE and the KV-cache write in one launch equal the norm GEMV then the RoPE write
kernel bit for bit (the kernels interpreted on the CPU), the op off CUDA is the two ops, a Llama layer's CUDA path
with OpChoices.rope_in_projection equals it without, and the kernel compiles for sm_90 with PDL."""

import os

import pytest
import torch

from draftgraph.ops.linear.op import add_rms_norm_qkv_rope_write
from draftgraph.ops.linear.triton_gemv import GemvConfig, add_rms_norm_gemv_triton, choose_config
from draftgraph.ops.linear.triton_qkv import _norm_gemv_rope_kernel, norm_gemv_rope_write_triton
from draftgraph.ops.rope.triton_rope import rope_qkv_write_triton
from tests.helpers import assert_pdl_order, compile_many_for_sm90

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HQ, HKV, D, K = 4, 2, 16, 48


def _inputs(dtype, bias: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = (HQ + 2 * HKV) * D
    x, r = (torch.randn(1, K, generator=g).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    w = (torch.randn(n, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    freqs = torch.tensor([37.0])[:, None] / (10000.0 ** (torch.arange(D // 2) * 2.0 / D))[None, :]
    cos, sin = torch.cat([freqs.cos(), freqs.sin()], -1).chunk(2, dim=-1)  # [1, D/2] views, as rope_lookup gives
    return x, r, nw, w, b, cos, sin


def _caches(dtype):
    return [torch.zeros(3, 4, HKV, D, dtype=dtype) for _ in range(2)]


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slot", [6, -1])
def test_kernel_equals_the_norm_gemv_then_the_rope_write(dtype, bias, slot):
    """Both tilings (choose_config's, and small K chunks with 4 columns a program): s, the rotated queries and the
    caches at the slot equal `_norm_gemv_kernel` then `_rope_qkv_kernel`'s, bit for bit; slot -1 writes nothing."""
    x, r, nw, w, b, cos, sin = _inputs(dtype, bias)
    slots = torch.tensor([slot])
    for config in (choose_config(1, K, norm=True), GemvConfig(block_n=4, block_k=16, num_warps=4)):
        got_caches, want_caches = _caches(dtype), _caches(dtype)
        s, q = norm_gemv_rope_write_triton(x, r, nw, 1e-5, w, b, cos, sin, *got_caches, slots, HQ, config)
        s_ref, qkv = add_rms_norm_gemv_triton(x, r, nw, 1e-5, w, b, config)
        qr, kr, vr = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q_ref = rope_qkv_write_triton(qr.view(1, HQ, D), kr.view(1, HKV, D), vr.view(1, HKV, D), cos, sin,
                                      *want_caches, slots)  # fmt: skip
        assert torch.equal(s, s_ref) and torch.equal(q, q_ref), config
        assert all(torch.equal(a, c) for a, c in zip(got_caches, want_caches)), config
        written = sum(int(c.abs().sum() > 0) for c in got_caches)
        assert written == (2 if slot >= 0 else 0)


def test_refuses_shapes_it_cannot_take():
    x, r, nw, w, b, cos, sin = _inputs(torch.bfloat16, False)
    caches = _caches(torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight \[\(Hq \+ 2 Hkv\) D, K\]"):
        norm_gemv_rope_write_triton(x, r, nw, 1e-5, w[:-1], b, cos, sin, *caches, torch.tensor([0]), HQ,
                                    choose_config(1, K, norm=True))  # fmt: skip
    with pytest.raises(ValueError, match="an even count whose half divides D / 2"):
        norm_gemv_rope_write_triton(x, r, nw, 1e-5, w, b, cos, sin, *caches, torch.tensor([0]), HQ,
                                    GemvConfig(block_n=32, block_k=16))  # fmt: skip


def test_op_off_cuda_is_the_two_ops():
    """The CPU op: add_rms_norm_linear's (s, qkv), then rope_qkv_write on qkv, at several rows; its fake and
    mutation annotations (opcheck)."""
    g = torch.Generator().manual_seed(3)
    _, _, nw, w, b, _, _ = _inputs(torch.float32, True)
    t = 3
    x, r = (torch.randn(t, K, generator=g) for _ in range(2))
    freqs = torch.arange(t, dtype=torch.float32)[:, None] / (10000.0 ** (torch.arange(D // 2) * 2.0 / D))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([0, -1, 5])
    caches, want_caches = _caches(torch.float32), _caches(torch.float32)
    s, q = add_rms_norm_qkv_rope_write(x, r, nw, 1e-5, w, b, cos, sin, *caches, slots, HQ)
    s_ref, qkv = torch.ops.draftgraph.add_rms_norm_linear(x, r, nw, 1e-5, w, b)
    qr, kr, vr = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q_ref = torch.ops.draftgraph.rope_qkv_write(qr.reshape(t, HQ, D), kr.reshape(t, HKV, D), vr.reshape(t, HKV, D),
                                                cos, sin, *want_caches, slots)  # fmt: skip
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref) and q.shape == (t, HQ, D)
    assert all(torch.equal(a, c) for a, c in zip(caches, want_caches))
    torch.library.opcheck(
        torch.ops.draftgraph.add_rms_norm_qkv_rope_write.default,
        (x, r, nw, 1e-5, w, b, cos, sin, *(c.clone() for c in caches), slots, HQ),
    )


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need the Triton interpreter")
def test_a_llama_decode_step_with_rope_in_projection_equals_without(monkeypatch):
    """A bf16 Llama's CUDA path run on the CPU with the kernels interpreted, prefill (8 rows: the op's two-op path)
    then a decode step (one row: the one kernel, in every layer but the first, whose input norm has no residual
    sum): the hidden states and the caches equal the model's without OpChoices.rope_in_projection, bit for bit."""
    import draftgraph.ops.linear.triton_qkv as tq
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.ops.choices import OpChoices
    from tests.helpers import cuda_path_prefill_then_decode, tiny_hf_model

    calls = []
    real = tq.norm_gemv_rope_write_triton
    monkeypatch.setattr(tq, "norm_gemv_rope_write_triton", lambda *a: calls.append(1) or real(*a))
    hf = tiny_hf_model("llama", vocab_size=96, head_dim=32).to(torch.bfloat16)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(4))
    results = {}
    for fused in (False, True):
        model = CausalLM.from_hf(hf, attn_impl="triton", dtype=torch.bfloat16,
                                 ops=OpChoices(rope_in_projection=fused))  # fmt: skip
        results[fused] = cuda_path_prefill_then_decode(model, ids, monkeypatch)
    (h0, c0), (h1, c1) = results[False], results[True]
    assert torch.equal(h0, h1) and all(torch.equal(a, b) for a, b in zip(c0, c1))
    assert len(calls) == model.cfg.num_layers - 1  # the decode step's layers after the first, in the fused run only
    assert any(c.abs().sum() > 0 for c in c1)


def test_kernel_compiles_for_a_hopper_gpu_with_pdl():
    """sm_90, bf16 with a bias and float32 without, PDL off and at level 3 (its first weight chunk before the wait,
    ops/triton_pdl.py)."""
    sig = {n: "*bf16" for n in ("x", "r", "nw", "w", "b", "s_out", "q_out", "k_cache", "v_cache")}
    sig.update({"cos": "*fp32", "sin": "*fp32", "slots": "*i64", "K": "i32", "swn": "i64", "eps": "fp32",
                "kv_row": "i64", "HQ": "i32", "HKV": "i32"})  # fmt: skip
    f32 = {**sig, **{n: "*fp32" for n in ("x", "r", "nw", "w", "b", "s_out", "q_out", "k_cache", "v_cache")}}
    common = {"HALF": 64, "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 4096, "ACCURATE": True}
    variants = [(sig, True, 0), (sig, True, 3), (f32, False, 3)]
    jobs = [(_norm_gemv_rope_kernel, s, {**common, "HAS_BIAS": b, "PDL": p}) for s, b, p in variants]
    for (_, _, level), got in zip(variants, compile_many_for_sm90(jobs)):
        assert "cubin" in got.stages()
        assert_pdl_order(got.ptx, level, weight_first=True)
