"""GPU tier: prefix caching in FULL_AND_PIECEWISE on CUDA (the cases of tests/test_prefix_cache.py: requests
sharing a 160-token prefix over three calls), Llama-3 with a draft model, DeepSeek-V3 with MTP and Qwen3.5 with MTP
(Gated DeltaNet state snapshots, runtime/state_snapshots.py), float32 with the Triton kernels and Inductor: tokens
equal transformers' greedy generate (Qwen3.5's on the CPU, its PyTorch path: tests/gpu/test_qwen3_5_cuda.py), the
later calls hit the cache and compute only the rest, the last call runs every forward from a graph, and every block
is free with no reference after each call."""

import pytest
import torch

from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from tests.gpu.test_qwen3_5_cuda import _ORACLE_SKIP
from tests.helpers import hf_greedy
from tests.test_prefix_cache import FAMILIES, MAX_TOKENS, PROMPTS, engine, hit_tokens, run_calls

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cached_prefixes_equal_transformers_in_full_and_piecewise(name):
    torch.backends.cuda.matmul.allow_tf32 = False
    make_hf, kind, shared = FAMILIES[name]
    hybrid = name.startswith("qwen3_5")
    if hybrid and _ORACLE_SKIP:
        pytest.skip(_ORACLE_SKIP)
    hf = make_hf()
    ref = hf_greedy(hf, PROMPTS, MAX_TOKENS) if hybrid else None  # on the CPU, without fla
    hf = hf.cuda()
    target = CausalLM.from_hf(hf, dtype=torch.float32, attn_impl="triton")
    fam = {"target": target, "drafter": builtin_drafter(kind, target)}
    eng = engine(fam, "FULL_AND_PIECEWISE", device="cuda", compile_backend="inductor", full_capture_sizes=(1, 2, 4))
    outs, stats = run_calls(eng)
    assert [outs[i] for i in range(len(PROMPTS))] == (ref or hf_greedy(hf, PROMPTS, MAX_TOKENS))
    assert [s["hit_tokens"] for s in stats] == hit_tokens(name)
    assert [s["prefill_tokens"] for s in stats] == [s["query_tokens"] - s["hit_tokens"] for s in stats]
    s = eng.stats()
    assert s["fallbacks"] == 0, s["fallbacks_by_key"]
    replays = eng.compiled.counters.graph_replays
    assert any(k.startswith("step/") for k in replays) and any("/piecewise/" in k for k in replays), dict(replays)
    if hybrid:
        assert s["prefix_cache"]["state_snapshots"]["restored"] == 4
