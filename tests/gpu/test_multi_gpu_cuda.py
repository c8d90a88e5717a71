"""GPU tier, two or more GPUs (issue 45): engines over NCCL, one process per GPU, give the one-GPU engine's greedy
tokens in FULL_AND_PIECEWISE, replay the one-graph step and fall back nowhere: tensor parallel 2 with the draft
model split (draft TP 2) and replicated (draft TP 1), and data parallel 2 with an uneven request count. Skipped,
with the reason, where fewer than two GPUs are visible."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a two-GPU device kind)"),
]

SPEC = BuiltinSpec(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=32, draft_layers=1)  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 9], [200, 5]]
PARAMS = dg.SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The built-in target and a draft model of its first layer (the same weights: drafts are often accepted)."""
    root = tmp_path_factory.mktemp("multi_gpu")
    target, drafter = builtin_hf_pair(SPEC)
    target.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")


def config(**over) -> dg.CompileConfig:
    fields = dict(mode="FULL_AND_PIECEWISE", device="cuda", dtype="float32", num_speculative_tokens=3,
                  max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, gpu_memory_utilization=0.0,
                  drafter_kind="draft_model", progress=False)  # fmt: skip
    return dg.CompileConfig(**{**fields, **over})


@pytest.fixture(scope="module")
def one_gpu(ckpts):
    with dg.compile_model(*ckpts, config()) as eng:
        return [o.token_ids for o in eng.generate(PROMPTS, PARAMS)], eng.stats()


@pytest.mark.parametrize(
    "over",
    [dict(tensor_parallel_size=2, draft_tensor_parallel_size=2), dict(tensor_parallel_size=2,
     draft_tensor_parallel_size=1), dict(data_parallel_size=2)],
    ids=["tp2-draft_tp2", "tp2-draft_tp1", "dp2"],
)  # fmt: skip
def test_parallel_engines_equal_one_gpu(ckpts, one_gpu, over):
    want, one_stats = one_gpu
    with dg.compile_model(*ckpts, config(**over)) as eng:
        got = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
        stats = eng.stats()
    assert got == want
    assert stats["fallbacks"] == 0, stats["fallbacks_by_key"]
    steps = {k: v for k, v in stats["dispatch"].items() if k.startswith("step/")}
    assert steps and all("/greedy" in k for k in steps), stats["dispatch"]  # the one-graph step, uniform batches
    print(f"{over}: {stats['accepted_tokens']} drafts accepted (one GPU {one_stats['accepted_tokens']}); {steps}")
