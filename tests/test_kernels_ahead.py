"""draftgraph's own kernels compiled ahead, side by side (compiler/pool/kernels_ahead.py, ops/launch.py): a traced
engine's calls of our ops are written as data, one per distinct call (the layers' identical attention calls
are one, submodules' calls included), each runs on zero inputs after a JSON round trip, and a large input keeps
its strides with fewer rows. Inside `compiling_ahead()` a launch site compiles (Triton's `warmup`) and launches
nothing; elsewhere it launches. On CUDA the calls compile the Triton kernels in threads (tests/gpu)."""

import json
from collections import Counter

import pytest
import torch
import triton

import draftgraph as dg
from draftgraph.compiler.pool.kernels_ahead import (
    MAX_TENSOR_BYTES,
    KernelsAhead,
    _tensor,
    async_compile_mode,
    op_calls,
    run_op_call,
)
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.launch import compiling_ahead, launch
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model


@pytest.fixture(scope="module")
def engine_graphs():
    """One engine's traced graphs for the tests that read them (built once: a build is most of each test)."""
    return _engine_graphs()


def _engine_graphs():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    config = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=4,
                              max_num_batched_tokens=64, compile_backend="eager", progress=False,
                              fuse_draft_loop=True)  # fmt: skip  # the loop's graphs name the drafter's choice
    engine = dg.compile_model(target, make_drafter("eagle", target), config)
    c = engine.compiled
    assert c.ahead is None  # on the CPU nothing compiles ahead
    return [gm for b in (c.target.backend, c.drafter.backend, c.loop_backend) for gm, _ in b.traces]


def test_calls_from_an_engine_run_on_zero_inputs(engine_graphs):
    gms = engine_graphs
    assert len(gms) == 4  # target, drafter, the greedy and the sampled loop
    in_graphs = Counter(
        str(n.target).split(".")[1] for gm in gms for n in gm.graph.nodes if "draftgraph" in str(n.target)
    )
    assert all(op_calls(gm) == [] for gm in gms)  # CUDA only by default: the CPU has no Triton kernels
    calls = [c for gm in gms for c in op_calls(gm, devices=("cpu",))]
    unique = {json.dumps(c, sort_keys=True): c for c in calls}
    names = Counter(c["op"].split("::")[1] for c in unique.values())
    # every attention call in the four graphs has the same layout at the example token count: one call
    assert names == {"paged_attention": 1, "sampling_probs": 1}
    assert in_graphs["paged_attention"] == 10 and in_graphs["sampling_probs"] == 3
    q = next(c for c in calls if c["op"].endswith("paged_attention"))["args"][0]["tensor"]
    assert q["shape"][0] == 16 and q["dtype"] == "float32"  # the unbacked token count at its example size
    for call in unique.values():
        run_op_call(json.loads(json.dumps(call)), "cpu")


SKIPPED = ["draftgraph::paged_attention: a torch.strided tensor on cpu"]


def test_the_thread_runs_each_distinct_call_once(engine_graphs):
    if async_compile_mode() is None:
        pytest.skip(f"Triton {triton.__version__} has no AsyncCompileMode: nothing compiles ahead with it")
    gms = engine_graphs
    ahead = KernelsAhead("cpu", threads=2)
    for gm in gms + gms:  # a repeat is not run again
        ahead.submit(op_calls(gm, devices=("cpu",)))
    assert ahead.submit_graph(gms[0]).wait(30)  # set once what is queued before it ran (nothing on CUDA here)
    done = ahead.close()
    # two distinct calls (attention, sampling); on the CPU they launch no Triton kernel
    # the graph's calls were on the CPU, which submit_graph (CUDA only) leaves out, saying why
    assert done == {"calls": 2, "kernels": 0, "failed": 0, "skipped": SKIPPED}, done


def test_submodules_are_searched(engine_graphs):
    gm = engine_graphs[0]
    split = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    split.add_submodule("inner", gm)  # a call inside a submodule (a piece) counts like one at the top
    assert op_calls(split, devices=("cpu",)) == op_calls(gm, devices=("cpu",)) != []


def test_large_inputs_keep_their_strides_with_fewer_rows():
    cache = torch.empty(2**16, 16, 8, 128, device="meta")  # 4 GiB of float32 KV cache blocks
    t = _tensor(cache, ("meta",))
    assert t["stride"] == list(cache.stride()) and t["shape"][1:] == [16, 8, 128]
    assert 1 <= t["shape"][0] * 16 * 8 * 128 * 4 <= MAX_TENSOR_BYTES < cache.numel() * 4


class _Kernel:
    """Stands in for a Triton JIT function: records launches and warm-ups."""

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append(("launch", grid, a, kw))

    def warmup(self, *a, grid, **kw):
        self.log.append(("warmup", grid, a, kw))


def test_launch_compiles_only_when_ahead():
    k = _Kernel()
    launch(k, (4, 2))(1, x=2)
    with compiling_ahead():
        launch(k, (8,))(3, BLOCK=16)
    launch(k, (1,))(5)
    assert [e[:2] for e in k.log] == [("launch", (4, 2)), ("warmup", (8,)), ("launch", (1,))]
    assert k.log[1][2:] == ((3,), {"BLOCK": 16})


@pytest.fixture(scope="module")
def step_engine():
    """fuse_draft_loop -> an engine with FULL capture sizes 1, 2 and 8, built at its first use and shared by the
    step-sampling tests (the race test reads the "auto" one too)."""
    built = {}

    def get(fuse):
        if fuse not in built:
            target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
            config = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=8,
                                      max_num_batched_tokens=64, full_capture_sizes=(1, 2, 8),
                                      compile_backend="eager", progress=False, fuse_draft_loop=fuse)  # fmt: skip
            built[fuse] = dg.compile_model(target, make_drafter("eagle", target), config)
        return built[fuse]

    return get


@pytest.mark.parametrize("fuse", ["auto", True])
def test_the_step_sampling_calls_are_written_by_hand_and_run(step_engine, fuse):
    """runtime/warmup.py seeds the one-graph step's token-choice calls before any graph names them: argmax and
    sampling probabilities over B x (K + 1) rows of the target's logits per FULL capture size B, and over B rows
    of the drafter's when the draft loop runs unfused in the step (auto; a fused loop's trace names its own)."""
    from draftgraph.runtime.warmup import step_sampling_calls

    engine = step_engine(fuse)
    calls = [c for c in step_sampling_calls(engine) if c["op"] != "draftgraph::race_sample"]  # (the next test's)
    sizes = sorted(engine.config.full_capture_sizes)
    rows = sorted({b * 4 for b in sizes} | (set(sizes) if fuse == "auto" else set()))  # (8 rows: both, once)
    assert rows == ([1, 2, 4, 8, 32] if fuse == "auto" else [4, 8, 32])
    assert [c["op"] for c in calls] == ["draftgraph::argmax_rows", "draftgraph::sampling_probs"] * len(rows)
    for call, n in zip(calls[::2], rows):
        assert call["args"][0]["tensor"] == {"dtype": "float32", "shape": [n, 96], "stride": [96, 1], "offset": 0}
    probs = calls[1]["args"]
    assert [a["tensor"]["dtype"] for a in probs] == ["float32", "float32", "int64", "float32"]
    for call in calls:  # each runs on zero inputs (on the CPU: the ops' reference paths)
        run_op_call(json.loads(json.dumps(call)), "cpu")


def test_the_race_kernel_calls_join_unless_opted_out(monkeypatch, step_engine):
    """The one-graph step's draws (the Triton race, ops/sampling/triton_race.py) are seeded too: one row per
    request, per FULL capture size, over the target's and the unfused drafter's vocabularies; with
    OpChoices(race_sampler=False) (the torch ops), none."""
    from dataclasses import replace

    from draftgraph.ops.choices import OpChoices
    from draftgraph.runtime.warmup import step_sampling_calls

    assert dg.CompileConfig().fuse_draft_loop == "auto"  # the default: the engine built for "auto" is this one
    engine = step_engine("auto")
    with monkeypatch.context() as m:  # the engine as resolved with the race sampler off
        m.setattr(engine, "config", replace(engine.config, ops=OpChoices(race_sampler=False)))
        assert not any(c["op"] == "draftgraph::race_sample" for c in step_sampling_calls(engine))
    race = [c for c in step_sampling_calls(engine) if c["op"] == "draftgraph::race_sample"]
    assert [c["args"][0]["tensor"]["shape"] for c in race] == [[1, 96], [2, 96], [8, 96]]  # one vocabulary here
    for call in race:
        assert [a["tensor"]["dtype"] for a in call["args"][:3]] == ["float32", "int64", "int64"]
        run_op_call(json.loads(json.dumps(call)), "cpu")  # the reference path on the CPU
