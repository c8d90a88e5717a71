"""passes/unfuse_addmm.py: Inductor's post-grad pass that keeps a residual add as mm + add on CUDA (no cuBLAS
addmm, whose residual copy is a kernel of its own), leaving broadcast biases and CPU code alone."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from draftgraph.compiler.config import CompileConfig, resolve
from draftgraph.compiler.inductor_options import inductor_patch, resolve_inductor_options
from draftgraph.ops.choices import OpChoices
from draftgraph.passes.unfuse_addmm import UnfuseResidualAddmm, unfuse_residual_addmm

aten = torch.ops.aten


SHAPES = {"residual": (4, 8), "x": (4, 8), "w": (8, 8), "bias": (8,)}


def f(residual, x, w, bias):
    h = aten.addmm.default(residual, x, w)  # a residual add Inductor fused: a [T, N] addend
    return aten.addmm.default(bias, h, w), h  # a bias: a broadcast [N] addend


def traced(device: str) -> torch.fx.GraphModule:
    """f's graph with fake values on `device` (fake CUDA tensors need no device), as Inductor's post-grad
    passes see graphs."""
    graph = torch.fx.Graph()
    with FakeTensorMode():
        env = {}
        for name, shape in SHAPES.items():
            env[name] = graph.placeholder(name)
            env[name].meta["val"] = torch.empty(*shape, device=device)
        h = graph.call_function(aten.addmm.default, (env["residual"], env["x"], env["w"]))
        h.meta["val"] = aten.addmm.default(*(env[k].meta["val"] for k in ("residual", "x", "w")))
        out = graph.call_function(aten.addmm.default, (env["bias"], h, env["w"]))
        out.meta["val"] = aten.addmm.default(env["bias"].meta["val"], h.meta["val"], env["w"].meta["val"])
    graph.output((out, h))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_cuda_residual_addmm_becomes_mm_and_add_bias_stays():
    gm = traced("cuda")
    assert count(gm, aten.addmm.default) == 2
    assert unfuse_residual_addmm(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert count(gm, aten.addmm.default) == 1 and count(gm, aten.mm.default) == 1
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert add.args[1] is mm and add.meta["val"].shape == (4, 8) and mm.meta["val"].shape == (4, 8)
    # The rewritten graph computes what it did (run on real CPU tensors).
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*shape, generator=g) for shape in SHAPES.values()]
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want)


def test_cpu_graph_is_left_alone():
    gm = traced("cpu")
    assert unfuse_residual_addmm(gm.graph) == 0 and count(gm, aten.addmm.default) == 2


def test_installed_for_every_compile_unless_a_pass_is_given():
    import torch._inductor.config as inductor_config

    with inductor_patch(()):
        assert isinstance(inductor_config.post_grad_custom_post_pass, UnfuseResidualAddmm)
        assert len(inductor_config.post_grad_custom_post_pass.uuid()) == 64  # enters Inductor's cache key
    mine = UnfuseResidualAddmm()
    with inductor_patch((("post_grad_custom_post_pass", mine),)):
        assert inductor_config.post_grad_custom_post_pass is mine
    # OpChoices(unfuse_addmm=False): resolve() pins the slot empty, so no pass is installed; a user's pass stays
    off = resolve_inductor_options(None, unfuse_addmm=False)
    assert off == (("post_grad_custom_post_pass", None),)
    with inductor_patch(off):
        assert inductor_config.post_grad_custom_post_pass is None
    assert resolve_inductor_options((("post_grad_custom_post_pass", mine),), unfuse_addmm=False) == (
        ("post_grad_custom_post_pass", mine),
    )
    rc = resolve(CompileConfig(ops=OpChoices(unfuse_addmm=False)), None, False)
    assert rc.inductor_options == off and not rc.ops.unfuse_addmm
