"""The peer-memory all-reduce's choices on the CPU (ops/collectives/peer.py; the kernels run in
tests/gpu/test_multi_gpu_cuda.py and tests/gpu/test_push_all_reduce_cuda.py): which kernel the measured rule gives a
message, when a group is refused peer memory (and why, by name), the config value, and that the all_reduce op keeps
NCCL / gloo when its group has no peer set up; the push kernel's buffer layout, and the kernel itself under the
Triton interpreter: two forked processes as two ranks over one shared CPU buffer, many calls back to back of mixed
sizes and widths (its slots and epochs). No engine, no process group beyond one gloo rank."""

import os

import pytest
import torch
import torch.multiprocessing as mp

import draftgraph as dg
from draftgraph.ops.collectives.peer import (
    RULES,
    AllReduceRule,
    PeerAllReduce,
    PeerInfo,
    choose_kernel,
    peer_access_refusal,
    peer_for,
    register_peer,
    unregister_peer,
)
from draftgraph.ops.collectives.push import PushAllReduce, PushLayout, prepare
from tests.helpers import assert_pdl_order, compile_many_for_sm90, join_forked

KIB = 1024
JOIN_S = 300
RULE = AllReduceRule(64 * KIB, 1024 * KIB, "test")
PUSH_RULE = AllReduceRule(64 * KIB, 1024 * KIB, "test", push_max_bytes=16 * KIB)


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


@pytest.mark.parametrize(
    "nbytes, dtype, want",
    [
        (8 * KIB, torch.bfloat16, "push"),
        (16 * KIB, torch.float32, "push"),  # the bound itself
        (8 * KIB, torch.float16, "push"),  # our kernel takes float16 too
        (16 * KIB + 4, torch.bfloat16, "one_shot"),
        (16 * KIB + 4, torch.float16, "nccl"),  # torch's kernels do not
        (8 * KIB + 2, torch.bfloat16, "nccl"),  # not 4-byte aligned
        (2 * 1024 * KIB, torch.bfloat16, "nccl"),
    ],
)
def test_choose_kernel_push_first(nbytes, dtype, want):
    assert choose_kernel(nbytes, dtype, 2, {2: PUSH_RULE}) == want


def test_push_layout_after_torchs_region():
    layout = PUSH_RULE.push_layout(2)
    assert layout == PushLayout(2, 16 * KIB, offset=1024 * KIB) and RULE.push_layout(2) is None
    assert [layout.data_at(s, r) for s in (0, 1) for r in (0, 1)] == [1024 * KIB + i * 16 * KIB for i in range(4)]
    assert layout.lamport_at(2) == 1024 * KIB + 64 * KIB and layout.lamport_at(4) == 1024 * KIB + 128 * KIB
    assert layout.flags_at == 1024 * KIB + 3 * 64 * KIB and layout.end == layout.flags_at + 8 * 128 * 2
    assert PUSH_RULE.buffer_bytes(2) == layout.end and RULE.buffer_bytes(2) == 1024 * KIB
    assert AllReduceRule(0, 100, push_max_bytes=256).push_layout(4).offset == 256  # rounded up to ALIGN
    # (programs, chunk, block): a program per 8 KiB, at most max_programs, chunks whole blocks
    assert layout.grid(8 * KIB, 2) == (1, 4096, 4096)
    assert layout.grid(8 * KIB + 16, 2) == (2, 4096, 4096)
    assert layout.grid(8 * KIB, 4) == (1, 2048, 2048)
    assert layout.grid(8 * KIB, 2, bytes_per_program=2 * KIB) == (4, 1024, 1024)
    assert PushLayout(2, 1024 * KIB).grid(1024 * KIB, 2) == (128, 4096, 4096)
    assert PushLayout(2, 1024 * KIB, max_programs=32).grid(1024 * KIB, 2) == (32, 16384, 4096)
    assert PushLayout(2, 1024 * KIB, max_programs=48).grid(1024 * KIB - 8, 2) == (43, 12288, 4096)  # whole blocks
    with pytest.raises(ValueError, match="multiples of 256"):
        PushLayout(2, 1000)
    with pytest.raises(ValueError, match="a power of two"):
        PushLayout(2, 1024, bytes_per_program=3000)
    with pytest.raises(ValueError, match="push_max_bytes=100"):
        AllReduceRule(0, 0, push_max_bytes=100)
    with pytest.raises(ValueError, match=r"push_kernel='fast'\): choose one of \['push', 'lamport'\]"):
        AllReduceRule(0, 0, push_kernel="fast")
    lamport = AllReduceRule(0, 0, push_max_bytes=1024, push_kernel="lamport")
    assert choose_kernel(1024, torch.bfloat16, 2, {2: lamport}) == "lamport"


def test_peer_all_reduce_without_push_region_declines_push_messages():
    """A forced rule sharing a buffer without the push kernel's state gives its push messages to NCCL."""

    class _Group:
        group_name = "g"

        def size(self):
            return 2

    peer = PeerAllReduce(_Group(), torch.empty(0, dtype=torch.uint8), PUSH_RULE)
    assert peer.kernel_for(torch.empty(1024, dtype=torch.bfloat16)) == "nccl"
    assert peer.kernel_for(torch.empty(16 * KIB, dtype=torch.bfloat16)) == "one_shot"


# ----------------------------------------------------------------------------- the push kernels, two CPU "ranks"
# (elements, dtype): 1 to 8 programs of 1 KiB; float16 (the lamport kernel's 2-byte rows; the interpreter rounds
# float16 as torch does, not bfloat16)
PUSH_SIZES = [(64, torch.float32), (1000, torch.float32), (2048, torch.float32), (16, torch.float16),
              (640, torch.float32), (4096, torch.float16), (100, torch.float16), (4, torch.float32),
              (1536, torch.float32)]  # fmt: skip
PUSH_CALLS = 3 * len(PUSH_SIZES)


def _push_rank(rank, whole, span, layout, inputs, results):
    shares = [whole[r * span : r * span + layout.end] for r in range(2)]
    push = PushAllReduce(layout, rank, shares[rank], [s.data_ptr() for s in shares])
    for i, pair in enumerate(inputs):  # the kernels in turn; every other call over programs of 256 bytes
        out = push.all_reduce(pair[rank], ("push", "lamport")[i % 3 > 0], bytes_per_program=256 if i % 2 else None)
        results[rank, i, : out.numel()] = out.float()
    results[rank, -1, :2] = push.state.float()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter")
def test_push_kernel_two_forked_ranks_many_calls():
    """Two processes share one CPU buffer (each rank's share 256-byte aligned, as on the GPU, `prepare`d); each
    makes the same PUSH_CALLS all-reduces of mixed sizes, dtypes, kernels and program counts back to back, some
    elements -0.0 (the lamport kernel's sentinel: sent as +0.0); every sum equals the sum of the two inputs, on
    both ranks, each rank's epoch counted every call (arrivals reset), and the lamport rows are re-armed."""
    layout = PushLayout(2, 8 * KIB, max_programs=8, bytes_per_program=1024)
    span = -(-layout.end // 256) * 256
    raw = torch.zeros(2 * span + 256, dtype=torch.uint8).share_memory_()
    off = (-raw.data_ptr()) % 256
    whole = raw[off : off + 2 * span]
    for r in range(2):
        prepare(whole[r * span : r * span + layout.end], layout)
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=g).to(dt) for _ in range(2)] for n, dt in PUSH_SIZES * 3]
    for i, pair in enumerate(inputs):
        pair[i % 2][::7] = -0.0  # a peer's -0.0 must not read as "not yet written"
        pair[0][::11] = -0.0
        pair[1][::11] = -0.0
    results = torch.full((2, PUSH_CALLS + 1, 4096), float("nan")).share_memory_()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_push_rank, args=(r, whole, span, layout, inputs, results)) for r in range(2)]
    for p in procs:
        p.start()
    join_forked(procs, JOIN_S, "a signal was lost")
    for i, (a, b) in enumerate(inputs):
        for rank in range(2):
            assert torch.equal(results[rank, i, : a.numel()], (a.float() + b.float()).to(a.dtype).float()), (i, rank)
    assert results[:, -1, :2].tolist() == [[PUSH_CALLS, 0], [PUSH_CALLS, 0]]
    for r in range(2):  # every lamport row back to the sentinel for the calls to come
        share = whole[r * span : r * span + layout.end]
        for size, bits in ((2, torch.int16), (4, torch.int32)):
            rows = share[layout.lamport_at(size) : layout.lamport_at(size) + layout.rows_bytes].view(bits)
            assert bool((rows == torch.iinfo(bits).min).all()), (r, size)


def test_push_all_reduce_refuses_what_its_rows_cannot_hold():
    """A message past the layout's row (it would run into the next rows, the lamport rows or the flags of every
    peer), of another dtype, empty or not contiguous, or an `out` that does not match, is refused before any launch
    (PeerAllReduce gives such messages to NCCL; this guards the kernels' other callers, e.g. scripts/bench_tp.py)."""
    layout = PushLayout(2, 1 * KIB, max_programs=4)
    span = -(-layout.end // 256) * 256
    raw = torch.zeros(2 * span + 256, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 256
    shares = [raw[off + r * span : off + r * span + layout.end] for r in range(2)]
    push = PushAllReduce(layout, 0, shares[0], [s.data_ptr() for s in shares])
    for x in (torch.zeros(0), torch.zeros(257, dtype=torch.float32), torch.zeros(513, dtype=torch.bfloat16),
              torch.zeros(8, dtype=torch.float64), torch.zeros(16, 4).t()):  # fmt: skip
        for kind in ("push", "lamport"):
            with pytest.raises(ValueError, match=r"push all-reduce: a contiguous .* of 1 to 1024 bytes, got"):
                push.all_reduce(x, kind)
    with pytest.raises(ValueError, match=r"push all-reduce: out torch.float16 \[256\] for a message torch.float32"):
        push.all_reduce(torch.zeros(256), "lamport", out=torch.zeros(256, dtype=torch.float16))
    assert push.fits(torch.zeros(256)) and push.state.tolist() == [0, 0]  # the bound itself fits; nothing ran


def test_the_shipped_rules_are_ordered_and_say_where_they_come_from():
    for world, rule in RULES.items():
        assert world >= 2 and 0 <= rule.one_shot_max_bytes <= rule.two_shot_max_bytes <= rule.buffer_bytes(world)
        assert max(rule.push_max_bytes, rule.two_shot_max_bytes) > 0 and rule.measured, world
        if rule.push_max_bytes:
            assert rule.push_layout(world).offset >= rule.two_shot_max_bytes  # torch's region first, then ours
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


def _one_rank_fails_in_the_rendezvous(tp) -> None:
    """Rank 1's rendezvous raises (the driver's mapping, say); rank 0's succeeds: both must refuse alike (a rank on
    NCCL while its peer waits in our kernels would hang at the first all-reduce). The CUDA parts are stood in for."""
    from unittest import mock

    import torch.distributed._symmetric_memory as symm_mem

    from draftgraph.ops.collectives import peer
    from draftgraph.ops.collectives.op import get_group

    class Handle:
        buffer_ptrs = (0, 0)

    def rendezvous(buffer, name):
        if tp.rank == 1:
            raise RuntimeError("mapping failed")
        return Handle()

    with (
        mock.patch.object(peer, "peer_access_refusal", return_value=""),
        mock.patch.object(symm_mem, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype)),
        mock.patch.object(symm_mem, "rendezvous", rendezvous),
        mock.patch.object(torch.cuda, "synchronize", lambda *a: None),
    ):
        got = peer.PeerAllReduce.setup(get_group("tp"), tp.rank, 0, {2: AllReduceRule(1024, 1024, "test")})
    assert got is None, f"rank {tp.rank} kept peer memory while rank 1 had refused it"


def test_a_rendezvous_failure_on_one_rank_is_every_ranks(tmp_path):
    from tests.test_tensor_parallel import spawn

    spawn(_one_rank_fails_in_the_rendezvous, 2, tmp_path)


@pytest.fixture(scope="module")
def sm90():
    """The push, lamport and fused kernels compiled for sm_90 in every element width they take, in one fresh
    process: the interpreter above runs code Triton's compiler refuses (it generated the 2-byte sentinel compare
    for float32 rows once, behind an early return in a constexpr if: TP engines in float32 did not start)."""
    from draftgraph.ops.collectives.fused import (
        ARM,
        _all_reduce_norm_gemv_kernel,
        _gemv_lamport_kernel,
        _lamport_read_kernel,
    )
    from draftgraph.ops.collectives.push import _lamport_all_reduce, _push_all_reduce

    common = {"RANK": 1, "WORLD": 2, "ROW": 4096, "UNIT": 64, "BLOCK": 1024, "PDL": 0}
    jobs = {}
    for dt, t in (("fp32", "*fp32"), ("bf16", "*bf16"), ("fp16", "*fp16")):
        sig = {"x_ptr": t, "out_ptr": t, "data_ptr": t, "deltas_ptr": "*i64", "state_ptr": "*i64", "n": "i32",
               "chunk": "i32"}  # fmt: skip
        jobs[f"lamport {dt}"] = (_lamport_all_reduce, sig, {**common, "WIDE": dt == "fp32"})
        jobs[f"push {dt}"] = (_push_all_reduce, {**sig, "flags_ptr": "*i64"}, common)
        if dt == "bf16":  # programmatic dependent launch (ops/triton_pdl.py)
            for level in (1, 3):
                jobs[f"lamport pdl {level}"] = (_lamport_all_reduce, sig, {**common, "WIDE": False, "PDL": level})
                jobs[f"push pdl {level}"] = (_push_all_reduce, {**sig, "flags_ptr": "*i64"}, {**common, "PDL": level})
        send = {"x": t, "w": t, "y": t, "rows": t, "deltas": "*i64", "state": "*i64", "N": "i32", "K": "i32",
                "swn": "i64"}  # fmt: skip
        jobs[f"send {dt}"] = (_gemv_lamport_kernel, send, {
            "RANK": 0, "WORLD": 2, "ROW": 4096, "UNIT": 64, "BLOCK_N": 4, "BLOCK_K": 1024, "SILU_MUL": dt == "bf16",
            "ACCURATE": True, "PDL": 3 if dt == "bf16" else 0})  # fmt: skip
        read = {**{n: t for n in ("x", "r", "nw", "w", "b", "s_out", "y", "rows")}, "rows2": "*i16", "rows4": "*i32",
                "state": "*i64", "N": "i32", "K": "i32", "swn": "i64", "eps": "fp32"}  # fmt: skip
        jobs[f"read {dt}"] = (_all_reduce_norm_gemv_kernel, read, {
            "RANK": 1, "WORLD": 2, "ROW": 4096, "ROW2": 8192, "ROW4": 4096, "HAS_BIAS": dt == "fp16", "BLOCK_N": 8,
            "BLOCK_K": 1024, "WHOLE": 4096, "WIDE": dt == "fp32", "ARM_BLOCK": ARM, "ACCURATE": True})  # fmt: skip
        reader = {"x": t, "out": t, "rows": t, "rows2": "*i16", "rows4": "*i32", "state": "*i64", "n": "i32",
                  "chunk": "i32"}  # fmt: skip
        jobs[f"reader {dt}"] = (_lamport_read_kernel, reader, {
            "RANK": 1, "WORLD": 2, "ROW": 4096, "ROW2": 8192, "ROW4": 4096, "BLOCK": 1024, "WIDE": dt == "fp32",
            "ARM_BLOCK": ARM, "PDL": 3 if dt == "bf16" else 0})  # fmt: skip
    return dict(zip(jobs, compile_many_for_sm90(list(jobs.values()))))


@pytest.mark.parametrize("kernel", ["lamport", "push", "send", "read", "reader"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_compile_for_a_hopper_gpu_in_every_width(sm90, kernel, dtype):
    assert "cubin" in sm90[f"{kernel} {dtype}"].stages()


def test_push_kernels_wait_for_the_kernel_before_under_pdl(sm90):
    """With programmatic dependent launch (ops/triton_pdl.py) the push and lamport kernels read their epoch, input
    and rows only after griddepcontrol.wait: the kernel before may still be running when they start."""
    assert_pdl_order(sm90["reader fp32"].ptx, 0)
    assert_pdl_order(sm90["reader bf16"].ptx, 3)  # (fused.py's reader kernel; its writer, the GEMV: test_linear_op)
    assert_pdl_order(sm90["send bf16"].ptx, 3, weight_first=True)
    for kernel in ("lamport", "push"):
        assert_pdl_order(sm90[f"{kernel} bf16"].ptx, 0)
        for level in (1, 3):
            assert "cubin" in sm90[f"{kernel} pdl {level}"].stages()
            assert_pdl_order(sm90[f"{kernel} pdl {level}"].ptx, level)
