"""The few-row linear op (ops/linear): the Triton GEMV (one row) and tensor-core kernel (2-16 rows) equal
F.linear, with and without bias, at masked tails and strided rows (interpreter here, CUDA on the device); both
compile for sm_90; the op is F.linear off CUDA and where its rule declines; it names every kernel variant a
symbolic row count may launch when compiled ahead; the models' layers keep F.linear's values and state-dict
names; bad configs and shapes name the fix."""

import pytest
import torch
import torch.nn.functional as F

import draftgraph.ops.linear.op  # noqa: F401  (registers torch.ops.draftgraph.linear)
from draftgraph.models.linear import Linear, head_logits, project
from draftgraph.ops.launch import compiling_ahead
from draftgraph.ops.linear.op import GemvRule
from draftgraph.ops.linear.triton_gemv import GemvConfig, _dot_kernel, _gemv_kernel, choose_config, gemv_triton
from tests.helpers import assert_pdl_order, compile_many_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "rows,dtype",
    [(1, torch.float32), (1, torch.bfloat16), (2, torch.bfloat16), (5, torch.float16), (16, torch.bfloat16)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_equal_f_linear(rows, bias, dtype):
    g = torch.Generator().manual_seed(rows)
    n, k = 38, 130  # neither a multiple of the tiles: masked tails in N and K (small: interpreted programs)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(n, k, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if bias else None)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # ~a half ulp
    small = GemvConfig(block_n=4, block_k=64, num_warps=2) if rows == 1 else GemvConfig(16, 64, 4, 2)
    for config in (small, choose_config(rows, k)):
        got = gemv_triton(x, w, b, config)
        assert got.shape == (rows, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol)


def test_strided_rows_and_weight():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 96, generator=g).to(DEVICE)
    x = base[:, 16:80]  # rows 96 apart, the last dim contiguous
    w = torch.randn(64, 40, generator=g).to(DEVICE).t()  # [40, 64] with its last dim strided
    got = gemv_triton(x[:1], w, None, choose_config(1, 64))
    torch.testing.assert_close(got, F.linear(x[:1], w), rtol=1e-4, atol=1e-4)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)  # [40, 64] with its last dim strided
    got = gemv_triton(xb, wb, None, choose_config(4, 64))
    torch.testing.assert_close(got.float(), F.linear(xb.float(), wb.float()), rtol=1e-2, atol=1e-2)


def test_op_is_f_linear_where_the_rule_declines_and_off_cuda():
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(2, 3, 24, generator=g), torch.randn(10, 24, generator=g), torch.randn(10, generator=g)
    got = torch.ops.draftgraph.linear(x, w, b)
    assert got.shape == (2, 3, 10) and torch.equal(got, F.linear(x, w, b))  # the CPU: F.linear itself
    torch.library.opcheck(torch.ops.draftgraph.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.draftgraph.linear.default, (x[0, :1], w, None))
    rule = GemvRule(max_rows=1)
    one = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert rule.takes(1, one, one) and not rule.takes(2, one, one) and not rule.takes(0, one, one)
    assert not rule.takes(1, one.float(), one.float())  # float32 stays on cuBLAS
    assert not GemvRule(max_rows=0).takes(1, one, one)
    head, proj = torch.zeros(32768, 8, dtype=torch.bfloat16), torch.zeros(16384, 8, dtype=torch.bfloat16)
    default = GemvRule()  # more rows: an LM head's weight only (cuBLAS won for the projections)
    assert default.takes(5, one, head) and default.takes(16, one, head) and not default.takes(17, one, head)
    assert default.takes(1, one, proj) and not default.takes(2, one, proj)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op's CUDA path (the rule, then the kernel)")
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_op_on_cuda_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16).cuda()
    w = (0.05 * torch.randn(384, 256, generator=g)).to(torch.bfloat16).cuda()
    got = torch.ops.draftgraph.linear(x, w, None)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_compiling_ahead_names_each_variant_without_launching(monkeypatch):
    """A trace leaves the row count symbolic: ahead, one call compiles the one-row kernel and the 2-16-row one."""
    import draftgraph.ops.linear.op as op
    import draftgraph.ops.linear.triton_gemv as tg

    seen = []
    monkeypatch.setattr(op, "GEMV_RULE", GemvRule(max_rows=16, multi_row_min_n=32))
    monkeypatch.setattr(tg, "launch", lambda kernel, grid: lambda *a, **kw: seen.append((kernel, kw)))
    x, w = torch.zeros(7, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with compiling_ahead():
        out = op.linear(x, w, None)
    assert out.shape == (7, 32)
    assert [k for k, _ in seen] == [_gemv_kernel, _dot_kernel]


@pytest.fixture(scope="module")
def sm90():
    """Every kernel of this file compiled for sm_90 in one fresh process (its start and imports cost more than a
    compile): label -> result; each test below checks its own kernels."""
    from draftgraph.ops.linear.triton_gemv import _norm_gemv_kernel, _silu_mul_kernel

    common = {"x": "*bf16", "w": "*bf16", "b": "*bf16", "y": "*bf16", "N": "i32", "K": "i32", "swn": "i64"}
    gemv = {"HAS_BIAS": True, "BLOCK_N": 4, "BLOCK_K": 1024, "SILU_MUL": False, "ACCURATE": True, "PDL": 0}
    jobs = {"gemv": (_gemv_kernel, common, gemv)}
    for bias in (False, True):
        constexprs = {"HAS_BIAS": bias, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "DOT_F32": False,
                      "PRECISION": "tf32" if not bias else "ieee"}  # fmt: skip
        jobs[f"dot bias={bias}"] = (_dot_kernel, {**common, "M": "i32", "sxm": "i64", "sym": "i64"}, constexprs)
    silu_gemv = {"HAS_BIAS": False, "BLOCK_N": 2, "BLOCK_K": 1024, "SILU_MUL": True, "ACCURATE": True, "PDL": 0}
    jobs["silu gemv"] = (_gemv_kernel, common, silu_gemv)
    silu_sig = {"x": "*bf16", "y": "*bf16", "M": "i32", "INTER": "i32", "sxm": "i64"}
    jobs["silu_mul"] = (_silu_mul_kernel, silu_sig, {"BLOCK": 1024, "ACCURATE": True})
    norm_sig = {n: "*bf16" for n in ("x", "r", "nw", "w", "b", "s_out", "y")}
    norm_sig.update({"N": "i32", "K": "i32", "swn": "i64", "eps": "fp32"})
    norm = {"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 2048, "ACCURATE": True, "PDL": 0}
    jobs["norm gemv"] = (_norm_gemv_kernel, norm_sig, norm)
    for level in (1, 2, 3):
        jobs[f"gemv pdl {level}"] = (_gemv_kernel, common, {**silu_gemv, "PDL": level})
        jobs[f"norm gemv pdl {level}"] = (_norm_gemv_kernel, norm_sig, {**norm, "PDL": level})
    return dict(zip(jobs, compile_many_for_sm90(list(jobs.values()))))


def test_kernels_compile_for_a_hopper_gpu(sm90):
    """The interpreter runs what Triton's compiler refuses: compile both for sm_90 here (no GPU needed)."""
    assert "cubin" in sm90["gemv"].stages()
    for bias in (False, True):
        assert "cubin" in sm90[f"dot bias={bias}"].stages()


def test_model_layers_keep_values_and_names(monkeypatch):
    g = torch.Generator().manual_seed(5)
    lin = Linear(24, 10, bias=True)
    ref = torch.nn.Linear(24, 10, bias=True)
    ref.load_state_dict(lin.state_dict())
    assert list(lin.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 24, generator=g)
    assert torch.equal(lin(x), ref(x)) and torch.equal(project(x, lin.weight, lin.bias, lin.ops), ref(x))
    assert torch.equal(head_logits(x, lin.weight, lin.ops), x @ lin.weight.t())


def test_bad_configs_and_shapes_name_the_fix():
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=3)
    with pytest.raises(ValueError, match="num_warps"):
        GemvConfig(num_warps=3)
    with pytest.raises(ValueError, match="0 \\(never\\) to 16"):
        GemvRule(max_rows=17)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gemv_triton(torch.zeros(3, 8), torch.zeros(4, 8), None, GemvConfig(16, 16, 4))
    from draftgraph.ops.linear.triton_gemv import add_rms_norm_gemv_triton

    two, norm_w, w = torch.zeros(2, 8), torch.ones(8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="add_rms_norm_gemv_triton takes x and residual \\[1, K\\]"):
        add_rms_norm_gemv_triton(two, two, norm_w, 1e-6, w, None, GemvConfig())
    with pytest.raises(ValueError, match="add_rms_norm_linear takes x and residual \\[\\.\\.\\., K\\], norm weight"):
        torch.ops.draftgraph.add_rms_norm_linear(two.to("meta"), two.to("meta"), torch.ones(7, device="meta"), 1e-6,
                                                 w.to("meta"), None)  # fmt: skip
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        torch.ops.draftgraph.linear(torch.zeros(2, 5, device="meta"), torch.zeros(4, 6, device="meta"), None)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_linear_is_the_swiglu_down_projection(rows, bias):
    """One row: the GEMV makes silu(gate) * up as it loads it; more rows: one elementwise kernel then F.linear.
    Both equal eager torch's MLP (silu rounded to the dtype, the product rounded again) to a bf16 ulp."""
    from draftgraph.ops.linear.triton_gemv import silu_mul_gemv_triton, silu_mul_triton

    g = torch.Generator().manual_seed(7 + rows)
    gate_up = torch.randn(rows, 2 * 96, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (0.1 * torch.randn(40, 96, generator=g)).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(40, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    gate, up = gate_up.split([96, 96], dim=-1)
    act = F.silu(gate) * up
    # two roundings; the interpreter truncates float32 -> bfloat16 (CUDA rounds to nearest): up to 2 ulps here
    torch.testing.assert_close(silu_mul_triton(gate_up).float(), act.float(), rtol=2e-2, atol=2e-2)
    want = F.linear(act.float(), w.float(), b.float() if bias else None)
    if rows == 1:
        got = silu_mul_gemv_triton(gate_up, w, b, choose_config(1, 96))
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    cpu = torch.ops.draftgraph.silu_mul_linear(gate_up.cpu(), w.cpu(), b.cpu() if bias else None)
    assert torch.equal(cpu, F.linear(F.silu(gate.cpu()) * up.cpu(), w.cpu(), b.cpu() if bias else None))
    torch.library.opcheck(torch.ops.draftgraph.silu_mul_linear.default, (gate_up.cpu(), w.cpu(), None))


def test_silu_kernels_compile_for_a_hopper_gpu(sm90):
    assert "cubin" in sm90["silu gemv"].stages()
    assert "cubin" in sm90["silu_mul"].stages()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_add_rms_norm_linear_is_the_add_the_norm_then_the_product(dtype, bias):
    """One row (the Llama layers' default on CUDA): s = x + residual and rms_norm(s) @ W.T + b in one launch, with
    ops/norm's roundings; the op off CUDA is add_rms_norm's reference then F.linear."""
    from draftgraph.ops.linear.triton_gemv import add_rms_norm_gemv_triton
    from draftgraph.ops.norm.op import rms_norm_reference

    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(1, 200, generator=g).to(dtype).to(DEVICE) for _ in range(2))  # K not a power of two
    nw = (1 + 0.1 * torch.randn(200, generator=g)).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(36, 200, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(36, generator=g).to(dtype).to(DEVICE) if bias else None
    s_ref = x + r
    y_ref = F.linear(rms_norm_reference(s_ref, nw, 1e-6).float(), w.float(), b.float() if bias else None)
    s, y = add_rms_norm_gemv_triton(x, r, nw, 1e-6, w, b, choose_config(1, 200, norm=True))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s.float(), s_ref.float(), **tol)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    xc, rc, nc, wc = x.cpu(), r.cpu(), nw.cpu(), w.cpu()
    s_cpu, y_cpu = torch.ops.draftgraph.add_rms_norm_linear(xc, rc, nc, 1e-6, wc, None)
    assert torch.equal(s_cpu, xc + rc) and torch.equal(y_cpu, F.linear(rms_norm_reference(xc + rc, nc, 1e-6), wc))
    torch.library.opcheck(torch.ops.draftgraph.add_rms_norm_linear.default, (xc, rc, nc, 1e-6, wc, None))


def test_norm_gemv_compiles_for_a_hopper_gpu(sm90):
    assert "cubin" in sm90["norm gemv"].stages()


def test_one_row_kernels_compile_with_programmatic_dependent_launch(sm90):
    """pdl levels (scripts/bench_gemv.py --pdl, ops/triton_pdl.py): the one-row kernels wait for the kernel
    before them (griddepcontrol.wait) before any load (1), or after loading a first chunk of weight only (2, 3), and
    release the next (griddepcontrol.launch_dependents) after their last load (1, 2) or first (3); as launched today,
    neither. Off CUDA, pdl is refused with the reason (the interpreter has no such launch)."""
    for kernel in ("gemv", "norm gemv"):
        assert_pdl_order(sm90[kernel].ptx, 0)
        for level in (1, 2, 3):
            assert "cubin" in sm90[f"{kernel} pdl {level}"].stages()
            assert_pdl_order(sm90[f"{kernel} pdl {level}"].ptx, level, weight_first=True)
    x, w = torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"pdl=4: 0 \(off\), 1, 2 or 3"):
        gemv_triton(x, w, None, choose_config(1, 16), pdl=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pdl=1: programmatic dependent launch needs a CUDA GPU"):
            gemv_triton(x, w, None, choose_config(1, 16), pdl=1)


def test_the_rule_launches_kernels_with_pdl_where_the_gpu_has_it(monkeypatch):
    """ops/launch.py's PdlRule (level 3 by default: bench_gemv.py --pdl's best) applies on compute capability 9.0
    and up, with a Triton that has griddepcontrol; elsewhere, and on the CPU, 0. A level the kernels do not have is
    refused, naming the levels."""
    from draftgraph.ops import launch

    with pytest.raises(ValueError, match=r"PdlRule.level=5: 0 \(off\), 1, 2 or 3"):
        launch.PdlRule(level=5)
    assert launch.PDL_RULE.level == 3 and launch.pdl_level(torch.device("cpu")) == 0
    monkeypatch.setattr(launch, "PDL_RULE", launch.PdlRule(level=0))
    assert launch.pdl_level(torch.device("cuda", 0)) == 0
    monkeypatch.setattr(launch, "PDL_RULE", launch.PdlRule())
    for capability, supported, want in (((9, 0), True, 3), ((8, 9), True, 0), ((10, 0), False, 0)):
        launch._has_pdl.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr("draftgraph.ops.triton_pdl.pdl_supported", lambda s=supported: s)
        assert launch.pdl_level(torch.device("cuda", 0)) == want
    launch._has_pdl.cache_clear()
