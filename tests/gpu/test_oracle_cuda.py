"""GPU tier: FULL_AND_PIECEWISE on CUDA (float32, Triton attention, CUDA graphs captured and replayed) against an
oracle we did not write: greedy tokens equal transformers' `generate()` on the CPU, for every Llama-family target
(Llama, Qwen2, Qwen3, Mistral: the goldens' tiny models, tests/goldens.py) with every drafter kind, and for
DeepSeek-V3 with its MTP drafter. (Qwen3.5 and DeepSeek-V3.2 are checked the same way in test_qwen3_5_cuda.py and
test_deepseek_v32_cuda.py; the CPU suite does it for every family in tests/test_goldens.py.)

Each case also shows that the compiled step ran: uniform batches replayed one-graph steps and nothing fell back.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from tests.goldens import FAMILIES, KINDS, case_hf
from tests.helpers import hf_greedy, tiny_deepseek_model

pytestmark = pytest.mark.gpu
# Prompts past one chunk of prefill and shorter than K + 1; 12 new tokens each (the vocabularies have >= 96 ids)
PROMPTS = [[3, 17, 91, 5, 44, 60, 2, 80, 33, 8, 71, 12, 40, 9, 1, 66, 23, 54, 7, 90, 31, 18], [9, 9], [50, 4, 27]]
MAX_TOKENS = 12


def generate_on_cuda(hf, kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(hf, device="cuda", dtype=torch.float32, attn_impl="triton")
    cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=4,
                           max_num_batched_tokens=32, capture_sizes=(1, 2, 4, 8, 16, 32), full_capture_sizes=(1, 2, 4),
                           device="cuda", gpu_memory_utilization=0.0, compile_backend="eager", progress=False,
                           check_addresses=True)  # fmt: skip
    params = dg.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with dg.compile_model(target, builtin_drafter(kind, target), cfg) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, params)], engine.stats()


def check(hf, kind):
    want = hf_greedy(hf, PROMPTS, MAX_TOKENS)  # on the CPU, transformers' PyTorch path, float32
    got, stats = generate_on_cuda(hf, kind)
    assert got == want, f"{kind}: FULL_AND_PIECEWISE on CUDA differs from transformers' generate()"
    steps = {key: n for key, n in stats["dispatch"].items() if key.startswith("step/")}  # one-graph steps
    assert steps and stats["fallbacks"] == 0, (stats["dispatch"], stats["fallbacks_by_key"])
    assert stats["verify_steps"] > 0, stats


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_full_and_piecewise_equals_transformers(family, kind):
    check(case_hf(family), kind)


def test_deepseek_v3_mtp_full_and_piecewise_equals_transformers():
    check(tiny_deepseek_model(), "mtp")
