"""The peer-memory all-reduce's choices on the CPU (ops/collectives/peer.py; the kernels run in
tests/gpu/test_multi_gpu_cuda.py): which kernel the measured rule gives a message, when a group is refused peer
memory (and why, by name), the config value, and that the all_reduce op keeps NCCL / gloo when its group has no
peer set up. No engine, no process group beyond one gloo rank."""

import pytest
import torch

import draftgraph as dg
from draftgraph.ops.collectives.peer import (
    RULES,
    AllReduceRule,
    PeerInfo,
    choose_kernel,
    peer_access_refusal,
    peer_for,
    register_peer,
    unregister_peer,
)

KIB = 1024
RULE = AllReduceRule(64 * KIB, 1024 * KIB, "test")


@pytest.mark.parametrize(
    "nbytes, dtype, world, want",
    [
        (8 * KIB, torch.bfloat16, 2, "one_shot"),  # a decode step's message at hidden 4096, B = 1
        (64 * KIB, torch.float32, 2, "one_shot"),  # the bound itself
        (64 * KIB + 4, torch.bfloat16, 2, "two_shot"),
        (1024 * KIB, torch.bfloat16, 2, "two_shot"),
        (1024 * KIB + 4, torch.bfloat16, 2, "nccl"),  # above the rule
        (8 * KIB, torch.float16, 2, "nccl"),  # torch's kernels: float32 and bfloat16 only
        (8 * KIB + 2, torch.bfloat16, 2, "nccl"),  # not 4-byte aligned
        (0, torch.bfloat16, 2, "nccl"),
        (8 * KIB, torch.bfloat16, 4, "nccl"),  # no rule measured for 4 ranks here
    ],
)
def test_choose_kernel_by_size_dtype_and_world(nbytes, dtype, world, want):
    assert choose_kernel(nbytes, dtype, world, {2: RULE}) == want


def test_the_shipped_rules_are_ordered_and_say_where_they_come_from():
    for world, rule in RULES.items():
        assert world >= 2 and 0 < rule.one_shot_max_bytes <= rule.two_shot_max_bytes == rule.buffer_bytes
        assert rule.measured, world
    with pytest.raises(ValueError, match="need 0 <= one_shot_max_bytes <= two_shot_max_bytes"):
        AllReduceRule(2 * KIB, KIB)


def test_peer_access_refusals_name_the_ranks_and_devices():
    ok = [PeerInfo(0, "h", 0, (1,)), PeerInfo(1, "h", 1, (0,))]
    assert peer_access_refusal(ok, 2, {2: RULE}) == ""
    one_way = [PeerInfo(0, "h", 0, (1,)), PeerInfo(1, "h", 1, ())]
    why = peer_access_refusal(one_way, 2, {2: RULE})
    assert "rank 1 (cuda:1) cannot access the memory of rank 0 (cuda:0)" in why and "peer-to-peer" in why
    hosts = [PeerInfo(0, "a", 0, (1,)), PeerInfo(1, "b", 0, (1,))]
    assert "spans hosts ['a', 'b']" in peer_access_refusal(hosts, 2, {2: RULE})
    assert "no measured all-reduce rule for 3 ranks (measured: [2])" in peer_access_refusal(ok, 3, {2: RULE})


def test_all_reduce_config_values():
    assert dg.CompileConfig().all_reduce == "auto"
    assert dg.CompileConfig(all_reduce="nccl").all_reduce == "nccl"
    with pytest.raises(ValueError, match=r"all_reduce='fast' is unknown; choose one of \['auto', 'nccl'\]"):
        dg.CompileConfig(all_reduce="fast")


class _Declines:
    """A registered peer whose rule gives every message to NCCL (the op's fallback path)."""

    calls = 0

    def all_reduce(self, x):
        self.calls += 1
        return None


def test_op_falls_back_to_the_group_collective_when_the_peer_declines(tmp_path):
    """One gloo rank: the op asks the group's peer first and sums with the process group when it declines."""
    import torch.distributed as dist

    from draftgraph.ops.collectives.op import register_group, unregister_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        register_group("peer-test", dist.group.WORLD)
        peer = _Declines()
        register_peer("peer-test", peer)
        x = torch.arange(6, dtype=torch.float32)
        out = torch.ops.draftgraph.all_reduce(x, "peer-test")
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and peer.calls == 1
        assert peer_for("peer-test") is peer
    finally:
        unregister_peer("peer-test")
        unregister_group("peer-test")
        dist.destroy_process_group()
    assert peer_for("peer-test") is None


def test_collective_fakes_shape_by_registered_sizes_alone():
    """A compile worker has no process group: the engine's group sizes travel with each job, and the collectives'
    fakes shape their outputs by them (compiler/pool/compile_worker.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import draftgraph.ops.collectives.rows  # noqa: F401  (registers the row collectives)
    from draftgraph.ops.collectives.op import group_size, register_group_sizes, unregister_group

    register_group_sizes({"sizes-only": 2})
    try:
        assert group_size("sizes-only") == 2 and group_size("") == 1
        with FakeTensorMode():
            x = torch.empty(3, 4)
            assert torch.ops.draftgraph.all_gather_last(x, "sizes-only").shape == (3, 8)
            assert torch.ops.draftgraph.all_gather_rows(x, "sizes-only").shape == (6, 4)
            assert torch.ops.draftgraph.reduce_scatter_rows(torch.empty(6, 4), "sizes-only").shape == (3, 4)
            assert torch.ops.draftgraph.all_reduce(x, "sizes-only").shape == (3, 4)
    finally:
        unregister_group("sizes-only")
    with pytest.raises(KeyError, match="no process group registered as 'sizes-only'"):
        group_size("sizes-only")
