"""GPU tier: Qwen3.5 (Gated DeltaNet + gated attention) with the gated_delta_net Triton kernels on CUDA.

- Greedy tokens of a tiny float32 model (tests/test_qwen3_5.py's: layer types mixed, a prompt of three
  chunks, 5 prompts through 2 slots) equal transformers' generate() in NONE, PIECEWISE and
  FULL_AND_PIECEWISE, for the target alone, with a truncated draft model and with the MTP head at K = 3 (and
  the MTP head at K = 1 and 5, and the MoE variant, in FULL_AND_PIECEWISE); in FULL_AND_PIECEWISE uniform
  batches run as one-graph steps and no forward runs without a graph.
- A prefill (runs of 300 and 700 tokens beside a verify run and a decode) at Qwen3.5's head dims: the
  kernels alone and with fla's chunked heads against the reference, outputs and every ring entry.
  fla-core must be installed for its case (the device README: pip install the wheels in .whl); float32
  inputs, tolerances: 1e-4 for our kernels (float32 in a different order), 1e-2 for fla (TF32 dots).

transformers binds fla's kernels into its Qwen3.5 module when that module is first imported and fla
imports; the oracle must be its PyTorch path, so this file imports that module with fla hidden first (run
it in its own pytest process, or before anything else imports transformers' Qwen3.5 module).
"""

import importlib
import importlib.util
import sys

import pytest
import torch

import draftgraph as dg
import draftgraph.ops.linear_attention.op  # noqa: F401  (registers torch.ops.draftgraph.gated_delta_net)
from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.linear_attention.chunked import fla_chunk_fn
from draftgraph.ops.linear_attention.reference import gated_delta_net_reference
from draftgraph.ops.linear_attention.triton_gdn import gated_delta_net_triton

pytestmark = pytest.mark.gpu
_QWEN = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _import_oracle_without_fla() -> str | None:
    """Import transformers' Qwen3.5 modules (dense and MoE) with fla hidden; a reason to skip if one was bound
    to fla before."""
    bound = [m for m in _QWEN if m in sys.modules and importlib.util.find_spec("fla") is not None]
    if bound:
        return f"{bound[0]} was imported with fla: run alone"
    saved = sys.modules.get("fla", False)
    sys.modules["fla"] = None  # import fla -> ImportError: transformers keeps its PyTorch functions
    try:
        for module in _QWEN:
            importlib.import_module(module)
    finally:
        if saved is False:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved
    return None


_ORACLE_SKIP = _import_oracle_without_fla()


@pytest.fixture(scope="module")
def model():
    if _ORACLE_SKIP:
        pytest.skip(_ORACLE_SKIP)
    from tests.test_qwen3_5 import hf_generate, tiny_qwen3_5

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_qwen3_5()
    ref = hf_generate(hf)  # on the CPU, transformers' PyTorch path
    return CausalLM.from_hf(hf, device="cuda", attn_impl="triton"), ref


def _generate_and_check(target, drafter, mode, k, ref):
    """Greedy tokens equal `ref`; in FULL_AND_PIECEWISE uniform batches replay graphs and nothing falls back."""
    from tests.test_qwen3_5 import prompts_and_params

    prompts, params = prompts_and_params()
    cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=k, max_num_seqs=2, max_num_batched_tokens=32,
                           device="cuda", gpu_memory_utilization=0.0, compile_backend="eager", progress=False,
                           check_addresses=True)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    stats = eng.stats()
    if drafter is not None:
        assert stats["verify_steps"] > 0
    if mode == "FULL_AND_PIECEWISE":
        steps = {key: n for key, n in stats["dispatch"].items() if key.startswith("step/")}  # one-graph steps
        assert steps and stats["fallbacks"] == 0, (stats["dispatch"], stats["fallbacks_by_key"])
    print(f"{mode} K={k}: {stats.get('acceptance_histogram')} {stats['dispatch']}")


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("kind", [None, "draft_model", "mtp"], ids=["target", "draft_model", "mtp"])
def test_greedy_tokens_equal_transformers(model, mode, kind):
    target, ref = model
    _generate_and_check(target, kind and builtin_drafter(kind, target), mode, 3, ref)


@pytest.mark.parametrize("k", [1, 5])
def test_mtp_at_other_draft_lengths(model, k):
    target, ref = model
    _generate_and_check(target, builtin_drafter("mtp", target), "FULL_AND_PIECEWISE", k, ref)


def test_moe_variant_with_mtp():
    if _ORACLE_SKIP:
        pytest.skip(_ORACLE_SKIP)
    from tests.test_qwen3_5 import hf_generate, tiny_qwen3_5

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_qwen3_5(moe=True)
    ref = hf_generate(hf)
    target = CausalLM.from_hf(hf, device="cuda", attn_impl="triton")
    _generate_and_check(target, None, "FULL_AND_PIECEWISE", 3, ref)
    _generate_and_check(target, builtin_drafter("mtp", target), "FULL_AND_PIECEWISE", 3, ref)


def _prefill_case(chunk_fn):
    """Runs of 300 and 700 tokens (from 0 and from 40), a verify of 4 at 57, a decode at 9; HK 4, HV 8,
    Dk = Dv = 128, W 4, ring 4: (outputs, conv rings, state rings) of the reference and of the kernels."""
    hk, hv, d, w, ring = 4, 8, 128, 4, 4
    c = 2 * hk * d + hv * d
    runs = [(0, 300), (57, 4), (40, 700), (9, 1)]
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(n for _, n in runs) + 3  # 3 padding tokens
    x = torch.randn(t, c, device="cuda", generator=g)
    decay = -torch.rand(t, hv, device="cuda", generator=g) * 0.2
    beta = torch.rand(t, hv, device="cuda", generator=g)
    wt = torch.randn(c, w, device="cuda", generator=g) * 0.5
    conv = torch.randn(5, ring + w - 2, c, device="cuda", generator=g)
    ssm = torch.randn(5, ring, hv, d, d, device="cuda", generator=g) * 0.05
    qsl, req, kvl = [0], [], []
    for r, (p0, n) in enumerate(runs):
        qsl.append(qsl[-1] + n)
        req += [r] * n
        kvl += list(range(p0 + 1, p0 + n + 1))
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (torch.tensor([2, 0, 1, 3], device="cuda"), torch.tensor(qsl, **i32),
            torch.tensor(req + [0] * 3, **i32), torch.tensor(kvl + [0] * 3, **i32))  # fmt: skip
    res = []
    for fn in (gated_delta_net_reference, lambda *a: gated_delta_net_triton(*a, chunk_fn=chunk_fn, min_run=128)):
        cs, ss = conv.clone(), ssm.clone()
        res.append((fn(x, decay, beta, wt, cs, ss, *meta), cs[:-1], ss[:-1]))
    return res


@pytest.mark.parametrize("path", ["kernels", "fla"])
def test_prefill_fla_and_kernels_against_the_reference(path):
    torch.backends.cuda.matmul.allow_tf32 = False
    if path == "fla" and fla_chunk_fn() is None:
        try:
            importlib.import_module("fla.ops.gated_delta_rule")
            why = "no chunk_gated_delta_rule"
        except ImportError as e:
            why = repr(e)
        pytest.skip(f"fla-core does not import: {why} (pip install the wheels in .whl first: tests/README.md)")
    tol = dict(atol=1e-4, rtol=1e-4) if path == "kernels" else dict(atol=1e-2, rtol=1e-2)
    calls = []

    def fla(*args, **kw):
        calls.append(kw["cu_seqlens_cpu"].tolist())
        return fla_chunk_fn()(*args, **kw)

    ref, got = _prefill_case(None if path == "kernels" else fla)
    assert calls == ([] if path == "kernels" else [[0, 296, 992]])  # the two long runs' heads (n - ring)
    for name, a, b in zip(("outputs", "conv ring", "state ring"), got, ref):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{path} {name}: {m}")
