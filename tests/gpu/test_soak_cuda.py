"""GPU tier: 2,000 steps of continuous batching (arrivals, departures, chunked prefill beside decodes)
in FULL_AND_PIECEWISE (one-graph steps for uniform batches, piece graphs for mixed ones) give the tokens of
eager mode NONE (run beside the tier's other tests, in a process of its own: tests/gpu/side_process.py)."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

pytestmark = pytest.mark.gpu


def workload(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 70, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 96, (m,), generator=g).tolist() for m in lengths]
    params = [
        dg.SamplingParams(max_tokens=int(torch.randint(4, 60, (1,), generator=g)), ignore_eos=True) for _ in range(n)
    ]
    arrivals = sorted(torch.randint(0, 2000, (n,), generator=g).tolist())
    return prompts, params, arrivals


def _engine(mode: str):
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    cfg = dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=16,
        max_num_batched_tokens=96,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
    )
    return dg.compile_model(target, make_drafter("eagle", target), cfg)


def eager_reference() -> dict:
    """Mode NONE over the workload: the tokens every compiled mode must give (run in a side process when the
    tier starts one: tests/gpu/side_process.py)."""
    eng = _engine("NONE")
    prompts, params, arrivals = workload(800)
    tokens = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
    return {"tokens": tokens, "steps": eng.stats()["steps"], "acceptance_rate": eng.stats()["acceptance_rate"]}


@pytest.mark.side_reference.with_args(eager_reference)  # with_args: a lone callable would be decorated
def test_two_thousand_steps_match_eager(side_reference):
    eng = _engine("FULL_AND_PIECEWISE")
    prompts, params, arrivals = workload(800)
    tokens = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
    s, ref = eng.stats(), side_reference(eager_reference)
    print(
        f"soak: {s['steps']} steps, {s['generated_tokens']} tokens, fallbacks {s['fallbacks']}, acceptance "
        f"{s['acceptance_rate']:.3f} (NONE {ref['acceptance_rate']:.3f}, {ref['steps']} steps); hits {s['dispatch']}"
    )
    assert s["steps"] >= 2000
    assert tokens == ref["tokens"]
    assert s["fallbacks"] == 0  # every step fit a captured graph
    assert any(key.startswith("step/") for key in s["dispatch"]) and any("/piecewise/" in key for key in s["dispatch"])
