"""The fused RoPE ops (ops/rope): on the CPU `rope_qkv` is the rotation models/rope.py always ran (and v made
contiguous); the Triton kernel (interpreter here, CUDA on the device) gives the same values from the strided views
of a fused QKV output, GQA and MHA head counts; it compiles for sm_90; bad shapes name the fix. `rope_qkv_write`
(the default with the Triton attention on CUDA) leaves the caches as the attention op's write would, in a model's
CUDA path (interpreted here) and through Inductor, which mutates the caches in place."""

import os

import pytest
import torch

from draftgraph.models.rope import apply_rope
from draftgraph.ops.rope.op import kernel_takes, rope_qkv, rotate_half
from draftgraph.ops.rope.triton_rope import _rope_qkv_kernel, rope_qkv_triton
from tests.helpers import assert_pdl_order, compile_many_for_sm90

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
    """Both variants: k and v into outputs (the default) and into the paged caches at the slots; with programmatic
    dependent launch (ops/triton_pdl.py) the kernel waits before its first load at every level."""
    sig = {n: "*bf16" for n in ("q", "k", "v", "q_out", "k_dst", "v_dst")}
    sig.update({"cos": "*fp32", "sin": "*fp32", "HQ": "i32"})
    sig.update({n: "i64" for n in ("sqt", "sqh", "skt", "skh", "svt", "svh", "sct", "sst", "kv_row")})
    variants = [(False, 0), (True, 0), (True, 1), (True, 3)]
    jobs = [(_rope_qkv_kernel, {**sig, "slots": "*i64"}, {"HALF": 64, "TO_CACHE": c, "PDL": p}) for c, p in variants]
    for (_, level), got in zip(variants, compile_many_for_sm90(jobs)):  # one process (its start costs the most)
        assert "cubin" in got.stages()
        assert_pdl_order(got.ptx, level)


def test_bad_shapes_name_the_fix():
    q, k, v, cos, sin = qkv_views(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cos and sin \\[T, D/2\\]"):
        torch.ops.draftgraph.rope_qkv(q.to("meta"), k.to("meta"), v.to("meta"), cos[:, :4].to("meta"), sin.to("meta"))
    bad = torch.zeros(3, 2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="twice a power of two"):
        rope_qkv_triton(bad, bad, bad, torch.zeros(3, 6, device=DEVICE), torch.zeros(3, 6, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_kv_write_fills_the_caches_as_the_attention_op_would(dtype):
    """`rope_qkv_write` (OpChoices(rope_kv_write=False) turns it off): the rotated queries, and the caches at the
    tokens' slots hold the rotated keys and the values (slot -1 skipped), exactly as write_kv_reference of rope_qkv's
    outputs leaves them; the CPU op is that reference (opcheck)."""
    from draftgraph.ops.attention.reference import write_kv_reference
    from draftgraph.ops.rope.op import rope_qkv_write
    from draftgraph.ops.rope.triton_rope import rope_qkv_write_triton

    q, k, v, cos, sin = qkv_views(5, 4, 2, 16, dtype, seed=3)
    slots = torch.tensor([7, 0, -1, 12, 3], device=DEVICE)
    caches = [torch.zeros(4, 4, 2, 16, dtype=dtype, device=DEVICE) for _ in range(4)]
    got_q = rope_qkv_write_triton(q, k, v, cos, sin, caches[0], caches[1], slots)
    want_q, want_k, want_v = rope_qkv_triton(q, k, v, cos, sin)
    write_kv_reference(want_k, want_v, caches[2], caches[3], slots)
    assert torch.equal(got_q, want_q) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].flatten(0, 1)[[1, 2, 4, 5]].abs().sum() == 0  # only the four valid slots were written
    qc, kc, vc, cc, sc = (x.cpu() for x in (q, k, v, cos, sin))
    kcache, vcache = torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)
    got_cpu = rope_qkv_write(qc, kc, vc, cc, sc, kcache, vcache, slots.cpu())
    assert torch.equal(got_cpu, rotate_half(qc, cc, sc))
    torch.testing.assert_close(kcache, caches[2].cpu(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    torch.library.opcheck(
        torch.ops.draftgraph.rope_qkv_write.default,
        (qc, kc, vc, cc, sc, kcache.clone(), vcache.clone(), slots.cpu()),
    )


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU the path runs natively, with the write by default: tests/gpu",
)
def test_the_cuda_path_of_a_llama_layer_with_the_fused_kv_write(monkeypatch):
    """A Llama model's CUDA path (norm ops, fused RoPE, residual adds in the norms, the Triton attention) run on the
    CPU with the kernels interpreted, prefill then a decode step: with the KV write inside the RoPE kernel the
    hidden states and the caches equal the path where the attention op writes them. Both paths run once (the
    unfused one, launching no fused write, is the reference: a second unfused run would repeat it)."""
    import draftgraph.ops.rope.triton_rope as tr
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.ops.choices import OpChoices
    from tests.helpers import cuda_path_prefill_then_decode, tiny_hf_model

    calls = []
    real = tr.rope_qkv_write_triton
    monkeypatch.setattr(tr, "rope_qkv_write_triton", lambda *a: calls.append(1) or real(*a))
    hf = tiny_hf_model("llama", vocab_size=96, head_dim=32)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(4))
    results = {}
    for write in (False, True):
        # F.linear (and no norm in the GEMV): the RoPE write under test
        model = CausalLM.from_hf(hf, attn_impl="triton", ops=OpChoices(gemv=False, rope_kv_write=write))
        results[write] = cuda_path_prefill_then_decode(model, ids, monkeypatch)
    (h0, c0), (h1, c1) = results[False], results[True]
    assert torch.equal(h0, h1) and all(torch.equal(a, b) for a, b in zip(c0, c1))
    assert len(calls) == 2 * model.cfg.num_layers  # the fused write ran per layer, in the fused run only
    assert any(c.abs().sum() > 0 for c in c1)


def test_inductor_writes_the_caches_in_place_through_both_ops():
    """Compiled, `rope_qkv_write` then the attention op (no rows of its own) mutate the caches in place: Inductor
    calls each op once on the cache inputs and copies no cache; the values equal eager's."""
    from torch._inductor.utils import run_and_get_code

    import draftgraph.ops.attention.op  # noqa: F401  (registers torch.ops.draftgraph.paged_attention)

    def step(q, k, v, cos, sin, kc, vc, slots, tables, req, kv_len):
        q = torch.ops.draftgraph.rope_qkv_write(q, k, v, cos, sin, kc, vc, slots)
        none = q.new_empty((0, k.shape[1], k.shape[2]))
        return torch.ops.draftgraph.paged_attention(
            q, none, none, kc, vc, slots, tables, req, kv_len, 0.25, 0, "triton"
        )

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton attention on the CPU needs the interpreter")
    q, k, v, cos, sin = qkv_views(3, 4, 2, 16, torch.float32, seed=5)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    req, kv_len = (
        torch.zeros(3, dtype=torch.int32, device=DEVICE),
        torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE),
    )
    caches = {name: torch.zeros(16, 4, 2, 16, device=DEVICE) for name in ("k_eager", "v_eager", "k", "v")}
    want = step(q, k, v, cos, sin, caches["k_eager"], caches["v_eager"], slots, tables, req, kv_len)
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(step, backend="inductor", dynamic=False), q, k, v, cos, sin,
                                  caches["k"], caches["v"], slots, tables, req, kv_len)  # fmt: skip
    code = "\n".join(codes)
    assert code.count("torch.ops.draftgraph.rope_qkv_write.default(") == 1
    assert code.count("torch.ops.draftgraph.paged_attention.default(") == 1
    assert "clone" not in code and ".copy_(" not in code, code
    torch.testing.assert_close(got, want)
    assert torch.equal(caches["k"], caches["k_eager"]) and torch.equal(caches["v"], caches["v_eager"])
