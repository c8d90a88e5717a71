"""draftgraph's custom ops go straight into the dispatcher (ops/registry.py): the same schema as
torch.library.custom_op gives (mutations declared), eager calls without custom_op's Python autograd layers, and
compiled code that functionalizes the mutation and matches eager."""

import pytest
import torch

from draftgraph.ops.registry import DEFINED_IN, custom_op


@custom_op("dgtest::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor, factor: float) -> torch.Tensor:
    out.copy_(x * factor)
    return x + factor


@scale_into.register_fake
def _(x, out, factor):
    return torch.empty_like(x)


def test_eager_call_runs_the_kernel_and_writes_in_place():
    x, out = torch.arange(4.0), torch.zeros(4)
    y = scale_into(x, out, 2.0)
    assert torch.equal(out, x * 2) and torch.equal(y, x + 2)
    schema = str(torch.ops.dgtest.scale_into.default._schema)
    assert "Tensor(a1!) out" in schema, schema  # the mutation is in the schema, as custom_op declares it
    assert DEFINED_IN["dgtest::scale_into"] == __name__


def test_compiled_call_matches_eager_and_keeps_the_write():
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(x, out):
        return torch.ops.dgtest.scale_into(x.sin(), out, 3.0).cos()

    x = torch.randn(8)
    ref_out, out = torch.zeros(8), torch.zeros(8)
    ref = f(x, ref_out)
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd functionalizes the op's mutation
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(x, out), ref)
    torch.testing.assert_close(out, ref_out)  # the in-place write survives functionalization
    compiled(torch.randn(8), out)
    assert counter.frame_count == 1 and counter.op_count >= 3  # one graph: sin, the op, cos


def test_every_draftgraph_op_is_defined_through_the_registry():
    import draftgraph.ops.attention.triton_advance  # noqa: F401  (every module that defines an op)
    import draftgraph.ops.collectives.rows  # noqa: F401
    import draftgraph.ops.moe.op  # noqa: F401
    import draftgraph.ops.sampling.op  # noqa: F401
    import draftgraph.ops.sampling.probs  # noqa: F401
    import draftgraph.ops.splitting  # noqa: F401

    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("draftgraph::"))
    assert len(ops) >= 14 and set(ops) <= set(DEFINED_IN), set(ops) - set(DEFINED_IN)
    for name in ops:  # no Python autograd layer around eager calls (torch.library.custom_op adds one)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView"), name


def test_bad_definitions_name_the_fix():
    def body(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="namespace::name"):
        custom_op("no_namespace")(body)
    with pytest.raises(ValueError, match=r"device_types \['tpu'\].*allowed"):
        custom_op("dgtest::bad_device", device_types=("tpu",))(body)
    with pytest.raises(TypeError, match="tuple of argument names"):
        custom_op("dgtest::bad_mutates", mutates_args="x")(body)
