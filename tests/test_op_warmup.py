"""draftgraph's own kernels compiled ahead, side by side (compiler/op_warmup.py): a traced engine's calls of our
ops are written as data, one per distinct call (the layers' identical attention calls are one), each runs on
zero inputs after a JSON round trip, the warmer's threads run each once (a repeat is not run again), and a
large input keeps its strides with fewer rows. On CUDA the calls compile the Triton kernels (tests/gpu)."""

import json
from collections import Counter

import torch

import draftgraph as dg
from draftgraph.compiler.op_warmup import MAX_TENSOR_BYTES, KernelWarmer, _tensor, op_calls, run_op_call
from draftgraph.models.llama import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model


def _engine_calls():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    config = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=4,
                              max_num_batched_tokens=64, compile_backend="eager", progress=False)  # fmt: skip
    engine = dg.compile_model(target, make_drafter("eagle", target), config)
    c = engine.compiled
    graphs = [gm.graph for b in (c.target.backend, c.drafter.backend, c.loop_backend) for gm, _ in b.traces]
    in_graphs = Counter(str(n.target).split(".")[1] for g in graphs for n in g.nodes if "draftgraph" in str(n.target))
    return graphs, in_graphs


def test_calls_from_an_engine_run_on_zero_inputs():
    graphs, in_graphs = _engine_calls()
    assert len(graphs) == 4  # target, drafter, the greedy and the sampled loop
    assert op_calls(graphs) == []  # CUDA only by default: a CPU engine has no Triton kernels to compile
    calls = op_calls(graphs, devices=("cpu",))
    names = Counter(c["op"].split("::")[1] for c in calls)
    # every attention call in the four graphs has the same layout at the example token count: one call
    assert names == {"paged_attention": 1, "sampling_probs": 1}
    assert in_graphs["paged_attention"] == 10 and in_graphs["sampling_probs"] == 3
    assert "piece_boundary" not in names  # launches nothing
    q = next(c for c in calls if c["op"].endswith("paged_attention"))["args"][0]["tensor"]
    assert q["shape"][0] == 16 and q["dtype"] == "float32"  # the unbacked token count at its example size
    for call in calls:
        run_op_call(json.loads(json.dumps(call)), "cpu")


def test_large_inputs_keep_their_strides_with_fewer_rows():
    cache = torch.empty(2**16, 16, 8, 128, device="meta")  # 4 GiB of float32 KV cache blocks
    t = _tensor(cache, ("meta",))
    assert t["stride"] == list(cache.stride()) and t["shape"][1:] == [16, 8, 128]
    assert 1 <= t["shape"][0] * 16 * 8 * 128 * 4 <= MAX_TENSOR_BYTES < cache.numel() * 4


def test_the_warmer_runs_each_call_once():
    graphs, _ = _engine_calls()
    calls = op_calls(graphs, devices=("cpu",))
    warmer = KernelWarmer("cpu", threads=2)
    try:
        futures = warmer.submit(calls + calls)
        assert len(futures) == len(calls) and warmer.wait(futures) >= 0 and warmer.done == len(calls)
        assert warmer.submit(calls) == []  # once per engine build
    finally:
        warmer.close()
