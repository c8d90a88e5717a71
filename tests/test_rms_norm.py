"""RMSNorm ops (ops/norm): `rms_norm` and `add_rms_norm` on the CPU are the Llama norm as models/layers.py always
computed it; the Triton kernel (interpreter here, CUDA on the device) gives the same values for [N, H] rows and
strided [T, heads, D] views, with and without the residual add; it compiles for sm_90; the decoder layer's
residual stream and norms keep their values; bad shapes name the fix."""

import pytest
import torch

from draftgraph.ops.norm.op import add_rms_norm, rms_norm, rms_norm_reference
from draftgraph.ops.norm.triton_rms_norm import _rms_norm_kernel, rms_norm_triton
from tests.helpers import compile_many_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: interpreted here, compiled on the device


def old_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_are_the_layer_norm_as_before(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 48, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), old_norm(x, w, 1e-6))
    s, y = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r) and torch.equal(y, old_norm(x + r, w, 1e-5))
    torch.library.opcheck(torch.ops.draftgraph.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.draftgraph.add_rms_norm.default, (x, r, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", ["rows", "heads view"])
def test_kernel_equals_the_reference(dtype, residual, shape):
    g = torch.Generator().manual_seed(1)
    if shape == "rows":
        x = torch.randn(7, 40, generator=g).to(dtype)  # H not a power of two: a masked tail
    else:  # q of a fused QKV output: [T, heads, D] with a row stride wider than heads x D
        x = torch.randn(3, 5 * 16, generator=g).to(dtype)[:, : 3 * 16].view(3, 3, 16)
    w = (1 + 0.1 * torch.randn(x.shape[-1], generator=g)).to(dtype)
    r = torch.randn(x.shape, generator=g).to(dtype) if residual else None
    x, w = x.to(DEVICE), w.to(DEVICE)
    r = r.to(DEVICE) if residual else None
    s, y = rms_norm_triton(x, r, w, 1e-6)
    base = x + r if residual else x
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # a bf16 ulp
    torch.testing.assert_close(y, rms_norm_reference(base, w, 1e-6), **tol)
    assert y.is_contiguous() and y.dtype == dtype
    if not residual:
        assert s is None
    elif dtype == torch.float32:
        assert torch.equal(s, base)  # the residual stream itself is exact
    else:  # the interpreter truncates float32 -> bfloat16 (CUDA rounds to nearest: exact, tests/gpu/test_norm_cuda.py)
        torch.testing.assert_close(s, base, rtol=1e-2, atol=1e-2)


def test_kernel_compiles_for_a_hopper_gpu():
    """The interpreter runs what Triton's compiler refuses: compile it for sm_90 here (no GPU needed)."""
    sig = {"x": "*bf16", "res": "*bf16", "w": "*bf16", "sum_out": "*bf16", "y_out": "*bf16", "sx0": "i64",
           "sx1": "i64", "sr0": "i64", "sr1": "i64", "n1": "i32", "H": "i32", "eps": "fp32"}  # fmt: skip
    jobs = [(_rms_norm_kernel, sig, {"HAS_RES": res, "BLOCK": 2048, "ACCURATE": True}) for res in (True, False)]
    for compiled in compile_many_for_sm90(jobs):  # both variants in one process (its start costs the most)
        assert "cubin" in compiled.stages()


def test_the_decoder_layer_keeps_its_residual_stream():
    """A Llama layer through the ops equals the layer written with plain adds and norms."""
    from draftgraph.models.config import ModelConfig
    from draftgraph.models.layers import DecoderLayer
    from tests.helpers import tiny_hf_model

    cfg = ModelConfig.from_hf(tiny_hf_model("llama").config, dtype=torch.float32)
    layer = DecoderLayer(cfg, 0, "reference").eval()
    x = torch.randn(4, cfg.hidden_size)
    a = torch.randn(4, cfg.hidden_size)
    h, n = layer.post_norm.add_forward(x, a)
    assert torch.equal(h, x + a) and torch.equal(n, old_norm(x + a, layer.post_norm.weight, layer.post_norm.eps))


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match=r"rms_norm takes x \[N, H\] or \[T, heads, H\] and weight \[H\]"):
        torch.ops.draftgraph.rms_norm(torch.zeros(2, 8, device="meta"), torch.zeros(4, device="meta"), 1e-6)


@pytest.mark.parametrize("cuda,kernel,want_ops", [(True, True, True), (True, False, False), (False, True, False)])
def test_the_layer_norms_use_the_ops_on_cuda(monkeypatch, cuda, kernel, want_ops):
    """On CUDA RMSNorm and the post-attention add are the ops (one node each in a trace) unless
    OpChoices.norm_kernel is off; on the CPU the torch ops, as the goldens record. (A CUDA trace without a GPU: CPU
    tensors that say they are on CUDA.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    from draftgraph.models.layers import RMSNorm
    from draftgraph.ops.choices import OpChoices

    device = "cuda" if cuda and torch.cuda.is_available() else "cpu"
    norm = RMSNorm(16, 1e-6, ops=OpChoices(norm_kernel=kernel)).to(device)
    fn = make_fx(lambda x, r: (norm(x), *norm.add_forward(x, r)))
    if cuda and device == "cpu":  # CPU tensors that say they are on CUDA: the kernels, interpreted
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    gm = fn(torch.randn(3, 16, device=device), torch.randn(3, 16, device=device))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    ops = {"draftgraph.rms_norm.default", "draftgraph.add_rms_norm.default"}
    assert (ops <= targets) if want_ops else not (ops & targets), targets


@pytest.mark.parametrize("norm_linear", ["0", "1"])
def test_sums_left_to_the_next_norm_give_the_same_values(monkeypatch, norm_linear):
    """On CUDA with the norm ops each Llama layer's residual add is made by the next layer's input norm (and the
    last one's by the final norm): the same float additions, so the hidden states and the aux layers' residual
    streams equal the layer-by-layer forward exactly; with the norms in the projections (CUDA's default) each add,
    norm and projection is one op (its CPU form here: the same torch ops). Off CUDA the layer-by-layer forward
    runs, with neither."""
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.models.layers import DecoderLayer
    from tests.helpers import PagedRunner, tiny_hf_model

    assert not DecoderLayer.norms_in_projections(None, torch.zeros(1))  # not on the CPU
    monkeypatch.setattr(DecoderLayer, "norms_in_projections", lambda self, r: norm_linear == "1")
    model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(2))
    assert not model.sums_in_norms(model.embed_tokens(ids))  # the CPU
    outs = {}
    for unsummed in (False, True):
        monkeypatch.setattr(CausalLM, "sums_in_norms", lambda self, h, on=unsummed: on)
        runner = PagedRunner(model.cfg)
        meta, pos = runner.batch([(0, 11)])
        with torch.no_grad():
            outs[unsummed] = model(ids, pos, meta, runner.cache.layers, aux_layers=(0, 2, 2))
    (h0, aux0), (h1, aux1) = outs[False], outs[True]
    assert torch.equal(h0, h1) and len(aux1) == 3 and all(torch.equal(a, b) for a, b in zip(aux0, aux1))
