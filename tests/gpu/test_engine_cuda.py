"""GPU tier: the lossless suite on CUDA with the Triton attention kernels (mode NONE).

float32 with TF32 off, so greedy ties are decided the same way in a batched verify and in single-token
decode; the CUDA outputs must also equal the CPU reference outputs token for token.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import KINDS, ragged

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def targets():
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model("llama", vocab_size=96)
    return CausalLM.from_hf(hf), CausalLM.from_hf(hf, device="cuda", attn_impl="triton")


def run(target, drafter, k, device, attention):
    prompts, params, arrivals = ragged(16)
    cfg = dg.CompileConfig(
        mode="NONE",
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device=device,
        attention=attention,
        gpu_memory_utilization=0.0,
    )
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng.stats()


def lossless_runs() -> dict:
    """Every run the lossless tests compare: the CPU reference and CUDA without a drafter, then each drafter kind
    at each K (started in a side process beside the tier's other tests: tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model("llama", vocab_size=96)
    cpu, cuda = CausalLM.from_hf(hf), CausalLM.from_hf(hf, device="cuda", attn_impl="triton")
    runs = {"cpu": run(cpu, None, 0, "cpu", "reference")[0], "cuda": run(cuda, None, 0, "cuda", "triton")[0]}
    for kind in KINDS:
        for k in K_VALUES:
            out, stats = run(cuda, make_drafter(kind, cuda), k, "cuda", "triton")
            runs[f"{kind}-{k}"] = {"tokens": out, **{f: stats[f] for f in STATS}}
    return runs


K_VALUES = [1, 2, 3, 5]
STATS = ("accepted_tokens", "draft_tokens", "acceptance_rate", "acceptance_histogram")


@pytest.fixture(scope="module")
def lossless(side_reference):
    runs = side_reference(lossless_runs)
    assert runs["cuda"] == runs["cpu"]  # CUDA with the Triton kernels = the CPU reference, token for token
    return runs


@pytest.mark.side_reference.with_args(lossless_runs)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", K_VALUES)
def test_lossless_on_cuda(lossless, kind, k):
    got = lossless[f"{kind}-{k}"]
    assert got["tokens"] == lossless["cuda"]
    assert 0 < got["accepted_tokens"] < got["draft_tokens"]
    print(f"{kind} K={k}: acceptance {got['acceptance_rate']:.3f} histogram {got['acceptance_histogram']}")


def test_sampling_on_cuda_is_seeded_and_batch_independent(targets):
    _, cuda = targets
    prompts, params, _ = ragged(16)
    sp = [
        dg.SamplingParams(max_tokens=p.max_tokens, temperature=0.8, top_k=20, seed=i, ignore_eos=True)
        for i, p in enumerate(params)
    ]
    cfg = dg.CompileConfig(
        mode="NONE", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
        gpu_memory_utilization=0.0,
    )  # fmt: skip
    a = dg.compile_model(cuda, make_drafter("eagle", cuda), cfg).generate(prompts, sp)
    b = dg.compile_model(cuda, make_drafter("eagle", cuda), cfg).generate(prompts[:5], sp[:5])
    assert [o.token_ids for o in a[:5]] == [o.token_ids for o in b]  # same seeds, another batch: same tokens
