"""GPU tier: a steady-state uniform step is one CUDA graph and waits on the device once.

Under `torch.cuda.set_sync_debug_mode("error")` any implicit synchronisation (a blocking copy, `.item()`,
`.tolist()` of a device tensor, a data-dependent shape) raises; the step's one wait is its explicit event
wait for the packed result (`HostCopy.waits`). Greedy and sampled, speculative and plain decoding, overlapped
(the next step queued before the last is read) and serial.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")


CASES = [(kind, t, True) for kind in ("eagle", "draft_model", None) for t in (0.0, 0.8)] + [("eagle", 0.8, False)]


@pytest.mark.parametrize("kind,temperature,overlap", CASES)
def test_steady_state_step_waits_once(target, kind, temperature, overlap):
    """Overlapped (the default), the first uniform step is only launched; every later one queues the next step
    and then waits once, for the step before it, so one step is always in flight. Serial, each waits once."""
    k = 3 if kind else 0
    cfg = dg.CompileConfig(
        overlap_steps=overlap,
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        gpu_memory_utilization=0.0,
        progress=False,
        compile_backend="eager",  # the step's host behaviour is under test, not Inductor's code
    )
    eng = dg.compile_model(target, make_drafter(kind, target) if kind else None, cfg)
    params = dg.SamplingParams(max_tokens=60, ignore_eos=True, temperature=temperature, top_k=20, top_p=0.9)
    for i in range(5):
        eng.add_request([1 + i, 2, 3, 4, 5], params)
    eng.step()  # the prefill (a mixed batch: the other path)
    host = eng.runner.host
    variant = "sample" if temperature else "greedy"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(6):
            before = host.waits
            eng.step()
            assert host.waits == before + (0 if overlap and i == 0 else 1)  # the packed result's copy
            assert (eng._pending is not None) == overlap
    finally:
        torch.cuda.set_sync_debug_mode(0)
    hits = eng.runner.forwards.hits
    assert hits[f"step/q{k + 1}/b8/{variant}"] == 6, dict(hits)  # 5 requests padded to the captured 8
    assert eng.stats()["fallbacks"] == 0
