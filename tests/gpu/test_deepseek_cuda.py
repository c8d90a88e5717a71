"""GPU tier: DeepSeek-V3 with the Triton MLA and grouped-expert kernels on CUDA.

Logits equal transformers' DeepseekV3ForCausalLM (float32, TF32 off) through chunked prefill and paged
decode in each MLA form; both forms' kernels match the references at V3's ranks (bf16);
the MTP drafter gives the tokens of mode NONE in PIECEWISE, FULL and FULL_AND_PIECEWISE, with the fused
K-step loop replayed as one graph and no fallbacks (float32: bfloat16 argmax ties may flip between
Inductor's and eager rounding; the bf16 kernels are checked in tests/test_deepseek.py and the benchmark).
"""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.deepseek import set_mla_form
from tests.copy_drafters import copy_deepseek_mtp
from tests.helpers import PagedRunner, tiny_deepseek_model
from tests.test_deepseek import MLAShape, check_chunked_logits, generate

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 32, 64, 72)


@pytest.fixture(scope="module")
def hf():
    torch.backends.cuda.matmul.allow_tf32 = False
    return tiny_deepseek_model().cuda()


@pytest.mark.parametrize("form", ["absorbed", "decompressed", "auto"])
def test_logits_match_transformers_with_triton_kernels(hf, form):
    """Chunked prefill and decode of two requests, each MLA form (tests/test_deepseek.py has the case)."""
    ours = CausalLM.from_hf(hf, attn_impl="triton")
    assert set_mla_form(ours, form) == 3
    check_chunked_logits(hf, ours, device="cuda")


@pytest.mark.parametrize("rows", [1, 4, 300])
def test_mla_kernels_at_deepseek_v3_ranks(rows):
    """r 512, RoPE 64, no-RoPE 128, V 128, 16 heads, bf16: both forms with the Triton kernels against the
    references, one request of `rows` new rows after 700 cached tokens plus a decode request."""
    heads, rank, rope, nope, head_v = 16, 512, 64, 128, 128
    gen = torch.Generator().manual_seed(0)
    w_kv_b = (torch.randn(heads * (nope + head_v), rank, generator=gen) * 0.05).cuda().bfloat16()
    outs = {}
    for impl in ("reference", "triton"):
        for form in ("absorbed", "decompressed"):
            runner = PagedRunner(
                MLAShape(torch.bfloat16, rank, rope), num_blocks=256, block_size=16, max_tokens=1024, device="cuda"
            )
            latent, rope_c = runner.cache.layers[0]
            g = torch.Generator().manual_seed(1)
            for parts in ([(0, 700), (1, 20)], [(0, rows), (1, 1)]):
                meta, _ = runner.batch(parts)
                t = meta.num_tokens
                q_nope, q_pe, c, pe = (
                    torch.randn(*shape, generator=g).cuda().bfloat16()
                    for shape in ((t, heads, nope), (t, heads, rope), (t, rank), (t, rope))
                )
                out = torch.ops.draftgraph.mla_attention(
                    q_nope, q_pe, c, pe, latent, rope_c, w_kv_b, meta.slot_mapping, meta.block_tables,
                    meta.token_req, meta.token_kv_len, 0.07, form, impl,
                )  # fmt: skip
            outs[impl, form] = out.float()
    ref = outs["reference", "absorbed"]
    for key, got in outs.items():
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2, msg=f"{key}")


def run(target, drafter, mode, temperature=0.0):
    return generate(
        target, drafter, mode, backend="inductor", sizes=SIZES, temperature=temperature, requests=16, device="cuda",
        full_capture_sizes=(1, 2, 4, 8), check_addresses=True,
    )  # fmt: skip


def again(eng, temperature: float) -> list:
    """The same 16 ragged requests as `run` gives, on an engine already built (at another temperature)."""
    import draftgraph as dg
    from tests.test_engine import ragged

    prompts, params, arrivals = ragged(16)
    params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=temperature, seed=i)
              for i, p in enumerate(params)] if temperature else params  # fmt: skip
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)]


def mtp_none_runs() -> dict:
    """Mode NONE's tokens (float32) that the MTP test compares every mode against: with the drafter greedy and at
    temperature 0.8, and greedy without it (run in a side process when the tier starts one:
    tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(tiny_deepseek_model().cuda(), dtype=torch.float32, attn_impl="triton")
    greedy, none = run(target, copy_deepseek_mtp(target), "NONE")
    return {"greedy": greedy, "sampled": again(none, 0.8), "plain": run(target, None, "NONE")[0]}


@pytest.mark.side_reference.with_args(mtp_none_runs)
def test_mtp_lossless_in_every_mode(hf, side_reference):
    """Every mode's tokens equal NONE's, greedy and sampled: each mode's engine is built once and generates at
    both temperatures (the build does not depend on them). float32 (bf16 kernels: tests/test_deepseek.py on
    CUDA, the benchmark)."""
    dtype = torch.float32
    target = CausalLM.from_hf(hf, dtype=dtype, attn_impl="triton")
    drafter = copy_deepseek_mtp(target)
    none = side_reference(mtp_none_runs)
    refs = {0.0: none["greedy"], 0.8: none["sampled"]}
    assert none["greedy"] == none["plain"]  # speculation changes nothing (greedy)
    for mode in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        out, eng = run(target, drafter, mode)
        for temperature in (0.0, 0.8):
            if temperature:
                out = again(eng, temperature)
            assert out == refs[temperature], (mode, temperature)
            s = eng.stats()
            if mode != "FULL":  # FULL has no piece graphs: its mixed (prefill) batches run without graphs
                assert s["fallbacks"] == 0, s["dispatch"]
            replays = eng.compiled.counters.graph_replays
            if mode != "PIECEWISE":
                variant = "/sample" if temperature else "/greedy"  # the one-graph step, in this run's variant
                assert any(key.startswith("step/q4/") and key.endswith(variant) for key in replays), dict(replays)
            print(f"{dtype} T={temperature} {mode}: acceptance {s['acceptance_histogram']} (runs so far)")
