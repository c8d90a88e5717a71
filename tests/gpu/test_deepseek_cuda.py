"""GPU tier: DeepSeek-V3 with the Triton MLA and grouped-expert kernels on CUDA.

Logits equal transformers' DeepseekV3ForCausalLM (float32, TF32 off) through prefill and paged decode;
the MTP drafter gives the tokens of mode NONE in PIECEWISE, FULL and FULL_AND_PIECEWISE, with the fused
K-step loop replayed as one graph and no fallbacks (float32: bfloat16 argmax ties may flip between
Inductor's and eager rounding; the bf16 kernels are checked in tests/test_deepseek.py and the benchmark).
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.llama import CausalLM
from tests.copy_drafters import copy_deepseek_mtp
from tests.helpers import PagedRunner, tiny_deepseek_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 32, 64, 72)


@pytest.fixture(scope="module")
def hf():
    torch.backends.cuda.matmul.allow_tf32 = False
    return tiny_deepseek_model().cuda()


def test_logits_match_transformers_with_triton_kernels(hf):
    ours = CausalLM.from_hf(hf, attn_impl="triton")
    ids = torch.randint(0, 96, (1, 21), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits[0]
    runner = PagedRunner(ours.cfg, block_size=4, device="cuda")
    got = []
    with torch.no_grad():
        meta, pos = runner.batch([(0, 9)])
        hidden, _ = ours(ids[0, :9], pos, meta, runner.cache.layers)
        got.append(ours.compute_logits(hidden))
        for t in range(9, 21):
            meta, pos = runner.batch([(0, 1)])
            hidden, _ = ours(ids[0, t : t + 1], pos, meta, runner.cache.layers)
            got.append(ours.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)


def run(target, drafter, mode, temperature=0.0):
    prompts, params, arrivals = ragged(16)
    if temperature:
        params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=temperature, seed=i)
                  for i, p in enumerate(params)]  # fmt: skip
    cfg = dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        capture_sizes=SIZES,
        full_capture_sizes=(1, 2, 4, 8),
        progress=False,
        check_addresses=True,
    )
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng


@pytest.mark.parametrize("dtype", [torch.float32])  # bf16 kernels: tests/test_deepseek.py on CUDA, the benchmark
def test_mtp_lossless_in_every_mode(hf, dtype):
    target = CausalLM.from_hf(hf, dtype=dtype, attn_impl="triton")
    drafter = copy_deepseek_mtp(target)
    for temperature in (0.0, 0.8):
        ref, eng = run(target, drafter, "NONE", temperature)
        if not temperature and dtype == torch.float32:
            assert ref == run(target, None, "NONE")[0]  # speculation changes nothing (greedy)
        for mode in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
            out, eng = run(target, drafter, mode, temperature)
            assert out == ref, (mode, temperature)
            s = eng.stats()
            if mode != "FULL":  # FULL has no piece graphs: its mixed (prefill) batches run without graphs
                assert s["fallbacks"] == 0, s["dispatch"]
            replays = eng.compiled.counters.graph_replays
            if mode != "PIECEWISE":
                assert any(key.startswith("drafter/loop/q4/") for key in replays), dict(replays)
                assert any(key.startswith("target/full/q4/") for key in replays), dict(replays)
            print(f"{dtype} T={temperature} {mode}: acceptance {s['acceptance_histogram']}")
