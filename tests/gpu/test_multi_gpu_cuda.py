"""GPU tier, two or more GPUs (issue 45): engines over NCCL, one process per GPU, give the one-GPU engine's greedy
tokens in FULL_AND_PIECEWISE, replay the one-graph step on every rank and fall back nowhere; where the GPUs reach
each other's memory, the tensor-parallel all-reduces go over peer memory (CompileConfig.all_reduce "auto", the
default: ops/collectives/peer.py) and each rank counts the all-reduces of the shipped rule's kernel for small messages
(push.py).

Cases: Llama-3 at TP 2 with a draft model split (draft TP 2) and replicated (draft TP 1); data parallel 2 with an
uneven request count; EAGLE-3 over a TP 2 target (draft TP 2 and 1); DeepSeek-V3 with its MTP head at TP 2 with
expert parallelism; DeepSeek-V3 at DP 2 with expert parallelism and an uneven request count (the idle replica's
dummy steps counted, no hang); Qwen3.5-MoE at TP 2 with expert parallelism; DeepSeek-V3.2 + MTP (draft TP 2) and
Qwen3.5 + MTP (draft TP 2 and 1) over TP 2; a rank killed mid-run makes the
driver raise naming it, and the other rank exit, each within KILL_S (a reporting bound on a hang, not a speed
check). Engines that several tests use are module fixtures. Skipped, with the reason, below two GPUs."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_pair, module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.collectives.peer import RULES
from tests.helpers import kill_rank_1_between_steps
from tests.test_data_parallel import deepseek_dir  # noqa: F401  (a module fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a two-GPU device kind)"),
]

SPEC = BuiltinSpec(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=32, draft_layers=1)  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 9], [200, 5]]
PARAMS = dg.SamplingParams(max_tokens=24, ignore_eos=True)
SMALL_PROMPTS = [[t % 90 for t in p] for p in PROMPTS]  # the tiny DeepSeek and Qwen3.5 models have 96 tokens
KILL_S = 30  # a killed rank is seen by its process sentinel at once: this long means the survivors hung


def config(**over) -> dg.CompileConfig:
    # speculation fixed here, not by conftest's pin: data-parallel worker processes never see that patch
    fields = dict(mode="FULL_AND_PIECEWISE", device="cuda", dtype="float32", num_speculative_tokens=3,
                  max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, gpu_memory_utilization=0.0,
                  progress=False, speculation="fixed")  # fmt: skip
    return dg.CompileConfig(**{**fields, **over})


def tokens(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, PARAMS)]


def check_ranks(engine, tp: int, one_graph: bool = True) -> list[dict]:
    """Every rank's own stats: no fallback, only one-graph steps (uniform batches) when `one_graph`, and on
    tensor-parallel ranks all-reduces by the shipped rule's push kernel over peer memory (captured at least once:
    a layer's pair)."""
    every = engine._call("stats")
    for rank, s in enumerate(every):
        assert s["fallbacks"] == 0, (rank, s["fallbacks_by_key"])
        steps = {k: v for k, v in s["dispatch"].items() if k.startswith("step/")}
        if one_graph:
            assert steps and all("/greedy" in k for k in steps), (rank, s["dispatch"])
        if tp > 1:
            assert s["peer_all_reduce"] is not None and s["peer_all_reduce"][RULES[2].push_kernel] >= 2, (rank, s)
    return every


# ----------------------------------------------------------------------------------------------- Llama + draft model
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The built-in target and a draft model of its first layer (the same weights: drafts are often accepted)."""
    root = tmp_path_factory.mktemp("multi_gpu")
    target, drafter = builtin_hf_pair(SPEC)
    target.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")


@pytest.fixture(scope="module")
def one_gpu(ckpts):
    with dg.compile_model(*ckpts, config(drafter_kind="draft_model")) as eng:
        return tokens(eng), eng.stats()


@pytest.fixture(scope="module")
def tp2(ckpts):
    """TP 2, the draft model split like the target; the last test kills one of its ranks."""
    eng = dg.compile_model(*ckpts, config(drafter_kind="draft_model", tensor_parallel_size=2))
    yield eng
    eng.close()


def test_tp2_draft_tp2_equals_one_gpu(tp2, one_gpu):
    want, one_stats = one_gpu
    assert tp2.config.tensor_parallel_size == 2 and tp2.config.draft_tensor_parallel_size == 2
    assert tokens(tp2) == want
    every = check_ranks(tp2, 2)
    assert every[0]["accepted_tokens"] == every[1]["accepted_tokens"] == one_stats["accepted_tokens"]


def test_the_cli_start_at_tp2_equals_one_gpu(ckpts, one_gpu):
    """What `draftgraph generate --tp 2` runs: ranks spawned before the command's imports, holding their CUDA contexts
    until the build sends their spec (workers/prestart.py), and lazy capture (each rank captures a graph, its
    all-reduces inside, at the step that first needs it, the same step as its peer)."""
    from draftgraph.workers import prestart

    want, _ = one_gpu
    prestart.prestart_ranks(2, cuda=True)
    held = [p.pid for p in prestart._held[-1].procs]
    with dg.compile_model(*ckpts, config(drafter_kind="draft_model", tensor_parallel_size=2, capture="lazy")) as eng:
        assert eng.pids == held and eng.config.lazy_capture
        assert tokens(eng) == want
        check_ranks(eng, 2)


@pytest.mark.parametrize(
    "over", [dict(tensor_parallel_size=2, draft_tensor_parallel_size=1), dict(data_parallel_size=2)],
    ids=["tp2-draft_tp1", "dp2"],
)  # fmt: skip
def test_parallel_engines_equal_one_gpu(ckpts, one_gpu, over):
    """Draft TP 1 (the draft model replicated); DP 2 over 5 requests (3 on one replica, 2 on the other)."""
    want, _ = one_gpu
    with dg.compile_model(*ckpts, config(drafter_kind="draft_model", **over)) as eng:
        assert tokens(eng) == want
        check_ranks(eng, over.get("tensor_parallel_size", 1))


def test_tp2_fused_all_reduce_plain_decode_equals_one_gpu(ckpts):
    """OpChoices.fuse_all_reduce (ops/collectives/fused.py): one request decoding alone (one row: o_proj's and down's
    all-reduces inside the GEMVs around them) and five together (the ops' unfused path) at TP 2 give the one-GPU
    engine's greedy tokens; the fused all-reduces ran (counted at capture and eagerly on every rank)."""
    from draftgraph.ops.choices import OpChoices

    plain = dict(num_speculative_tokens=0)
    with dg.compile_model(ckpts[0], None, config(**plain)) as eng:
        want = tokens(eng, PROMPTS[:1]), tokens(eng)
    over = dict(tensor_parallel_size=2, ops=OpChoices(fuse_all_reduce=True), **plain)
    with dg.compile_model(ckpts[0], None, config(**over)) as eng:
        assert (tokens(eng, PROMPTS[:1]), tokens(eng)) == want
        every = check_ranks(eng, 2)
        assert all(s["peer_all_reduce"]["fused"] > 0 for s in every), [s["peer_all_reduce"] for s in every]


# ------------------------------------------------------------------------------------------------------------ EAGLE-3
@pytest.fixture(scope="module")
def eagle3(ckpts):
    """An EAGLE-3 head (a module of upstream-named weights) that copies the target's last hidden state to its own
    LM head, its layer turned down (tests/test_tp_drafters.py); the one-GPU engine's tokens."""
    from tests.test_tp_drafters import head_weights

    full = CausalLM.from_pretrained(ckpts[0], dtype=torch.float32, device="cpu")
    head = module_from_state_dict(head_weights("eagle3", full))
    with dg.compile_model(ckpts[0], head, config(drafter_kind="eagle3")) as eng:
        return head, tokens(eng), eng.stats()["accepted_tokens"]


@pytest.mark.parametrize("draft_tp", [2, 1])
def test_eagle3_over_tp2_equals_one_gpu(ckpts, eagle3, draft_tp):
    head, want, accepted = eagle3
    cfg = config(drafter_kind="eagle3", tensor_parallel_size=2, draft_tensor_parallel_size=draft_tp)
    with dg.compile_model(ckpts[0], head, cfg) as eng:
        assert tokens(eng) == want
        every = check_ranks(eng, 2)
    assert every[0]["accepted_tokens"] == every[1]["accepted_tokens"] == accepted  # the same drafts, accepted alike


# -------------------------------------------------------------------------------------------- MoE: expert parallelism
@pytest.fixture(scope="module")
def deepseek_one(deepseek_dir):  # noqa: F811
    """The one-GPU engine's tokens for the tiny DeepSeek-V3 with its MTP head (tests/test_data_parallel.py)."""
    path, _ = deepseek_dir
    with dg.compile_model(path, path, config()) as eng:
        return tokens(eng, SMALL_PROMPTS), eng.stats()["accepted_tokens"]


def test_deepseek_v3_mtp_tp2_expert_parallel_equals_one_gpu(deepseek_dir, deepseek_one):  # noqa: F811
    path, (want, accepted) = deepseek_dir[0], deepseek_one
    with dg.compile_model(path, path, config(tensor_parallel_size=2, expert_parallel=True)) as eng:
        assert "experts 0-3 of 8 in each of 2 MoE layers on rank 0 of 2 (tp 2 x dp 1)" in eng.warm_up_report
        assert tokens(eng, SMALL_PROMPTS) == want
        every = check_ranks(eng, 2)
    assert accepted > 0 and every[0]["accepted_tokens"] == accepted


def test_deepseek_dp2_expert_parallel_uneven_requests(deepseek_dir, deepseek_one):  # noqa: F811
    """DP 2, EP 2: three requests, one 24 tokens long and two 4 long, so the replica without the long one runs
    dummy steps of the shared shape while the other decodes; outputs equal the one-GPU engine's, in order, and nothing
    hangs; every step of the busy replica is a step, real or dummy, of the idle one."""
    path, (want, _) = deepseek_dir[0], deepseek_one
    lengths = [24, 4, 4]
    params = [dg.SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    with dg.compile_model(path, path, config(data_parallel_size=2, expert_parallel=True)) as eng:
        outs = eng.generate(SMALL_PROMPTS[:3], params)
        assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, lengths)]
        assert [o.request_id for o in outs] == [0, 1, 2]
        check_ranks(eng, 1, one_graph=False)  # an idle replica's dummy steps are not the one-graph step
        idle, busy = sorted(eng.stats()["per_replica"], key=lambda r: r["dummy_steps"], reverse=True)
    assert busy["dummy_steps"] == 0 and idle["dummy_steps"] > 0, (busy, idle)
    assert idle["steps"] + idle["dummy_steps"] == busy["steps"]


def test_qwen3_5_moe_tp2_expert_parallel_equals_one_gpu(tmp_path):
    from tests.test_qwen3_5 import tiny_qwen3_5

    tiny_qwen3_5(moe=True).save_pretrained(tmp_path)
    with dg.compile_model(str(tmp_path), None, config()) as eng:
        want = tokens(eng, SMALL_PROMPTS)
    with dg.compile_model(str(tmp_path), None, config(tensor_parallel_size=2, expert_parallel=True)) as eng:
        assert "experts 0-1 of 4 in each of 4 MoE layers on rank 0 of 2 (tp 2 x dp 1)" in eng.warm_up_report
        assert tokens(eng, SMALL_PROMPTS) == want
        check_ranks(eng, 2)


# ------------------------------------------------------------------------------------- MTP heads over a TP 2 target
def _one_gpu_head(target_dir: str, head, prompts) -> tuple[list[list[int]], int]:
    """The one-GPU engine's tokens and accepted drafts for `head` (a module of upstream-named MTP weights)."""
    with dg.compile_model(target_dir, head, config(drafter_kind="mtp")) as eng:
        return tokens(eng, prompts), eng.stats()["accepted_tokens"]


def _head_over_tp2(target_dir: str, head, prompts, want: tuple[list[list[int]], int], draft_tp: int) -> None:
    """`head` over the target at TP 2, split (draft TP 2) or replicated (draft TP 1): tokens and accepted drafts
    equal the one-GPU engine's (`want`)."""
    cfg = config(drafter_kind="mtp", tensor_parallel_size=2, draft_tensor_parallel_size=draft_tp)
    with dg.compile_model(target_dir, head, cfg) as eng:
        assert tokens(eng, prompts) == want[0], draft_tp
        every = check_ranks(eng, 2)
    assert every[0]["accepted_tokens"] == every[1]["accepted_tokens"] == want[1], draft_tp


def test_deepseek_v32_mtp_over_tp2_equals_one_gpu(tmp_path):
    """DeepSeek-V3.2 (sparse MLA + indexer) with an MTP layer that mostly repeats the target (test_tp_deepseek's)."""
    from tests.test_deepseek_v32 import tiny_v32_model
    from tests.test_tp_deepseek import mtp_weights

    hf = tiny_v32_model()
    hf.save_pretrained(tmp_path)
    head = module_from_state_dict(mtp_weights(CausalLM.from_hf(hf)))
    _head_over_tp2(str(tmp_path), head, SMALL_PROMPTS, _one_gpu_head(str(tmp_path), head, SMALL_PROMPTS), 2)


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory):
    """Qwen3.5 (Gated DeltaNet + gated attention) saved, its MTP head (random `mtp.*` weights) and the one-GPU
    engine's result: shared by the two draft TPs (each test then builds one TP 2 engine: three engines in one test
    did not finish inside a 10-minute device call)."""
    from draftgraph.models.drafters.qwen3_5_mtp import random_mtp_weights
    from tests.test_qwen3_5 import tiny_qwen3_5

    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf = tiny_qwen3_5()
    hf.save_pretrained(root)
    head = module_from_state_dict(random_mtp_weights(CausalLM.from_hf(hf).cfg, torch.Generator().manual_seed(3)))
    return str(root), head, _one_gpu_head(str(root), head, SMALL_PROMPTS)


@pytest.mark.parametrize("draft_tp", [2, 1])
def test_qwen3_5_mtp_over_tp2_equals_one_gpu(qwen3_5_mtp, draft_tp):
    """Qwen3.5 with its MTP head over TP 2, the head split (draft TP 2) and replicated (draft TP 1)."""
    root, head, want = qwen3_5_mtp
    _head_over_tp2(root, head, SMALL_PROMPTS, want, draft_tp)


# ------------------------------------------------------------------------------------------------------- a dead rank
def test_a_killed_rank_stops_the_other_naming_it(tp2):
    """Runs last (it ends the shared TP 2 engine): rank 1 killed between steps of a running request; the next
    step raises WorkerError naming rank 1, and rank 0's process is gone, each within KILL_S."""
    kill_rank_1_between_steps(tp2, PROMPTS[0], PARAMS, KILL_S)
