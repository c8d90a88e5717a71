"""Small all-reduces over peer memory: our push and lamport kernels (push.py) and torch symmetric memory's one-shot
and two-shot kernels, inside CUDA graphs.

A decode step's all-reduces are small (batch x hidden x 2 bytes: 8 KB for one request at hidden 4096) and there
are two per layer; NCCL's ring takes 10-20 us for each, most of it latency. Over NVLink a rank can read its
peers' memory directly: torch.distributed._symmetric_memory maps one buffer of every rank into each rank's
address space, and its `one_shot_all_reduce_copy` copies this rank's input into its buffer, waits at a barrier
of signal flags in peer memory, then sums every rank's buffer into a fresh output (one kernel launch, no side
stream, capturable in a CUDA graph); `two_shot_all_reduce_out` reduces a 1/world slice per rank then gathers
(less traffic for larger messages). Our kernels (push.py) are one launch as well, with no barrier at either end:
each rank stores its input into every peer's buffer and sums locally once its peers' data is there (push: a flag
after the data; lamport: the data is its own signal, polled against a -0.0 sentinel).

Which kernel sums a message is a measured rule held here as data: `RULES[world_size]` gives the largest message
our kernel (push or lamport; float32, bfloat16, float16) and torch's one-shot and two-shot kernels (float32,
bfloat16) take; anything larger, or of another dtype, or not 4-byte aligned, goes to NCCL (the caller's
fallback). World sizes without a measured rule use NCCL throughout.

`PeerAllReduce.setup(group)` (collective over the group, once, when the group is made: workers/worker.py)
checks that every rank of the group is on one host and can reach every peer's device memory (CUDA P2P); if not
it refuses with a logged message naming the ranks and devices, and the group keeps NCCL. The symmetric buffer
is allocated once (torch's kernels' largest message, then our kernels' rows and flags: push.py's PushLayout; 2
ranks up to 8 MiB: 96 MiB a GPU) and registered under the group's name, where the all_reduce op
(op.py) finds it. All ranks of a group make the same all-reduces in the same order (SPMD), as with NCCL; the
kernels run on the current stream, so two all-reduces of one group must never run concurrently on two streams.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

import torch

from draftgraph.ops.collectives.push import ALIGN, PUSH_DTYPES, PUSH_KINDS, PushAllReduce, PushLayout, prepare

log = logging.getLogger("draftgraph")

KERNELS = ("push", "lamport", "one_shot", "two_shot", "nccl")
PEER_DTYPES = (torch.float32, torch.bfloat16)  # what torch's symmetric-memory reduction kernels are built for


@dataclass(frozen=True)
class AllReduceRule:
    """Messages of at most `push_max_bytes` take our kernel `push_kernel` ("push" or "lamport": push.py), then up to
    `one_shot_max_bytes` torch's one-shot kernel, then up to `two_shot_max_bytes` its two-shot kernel, larger ones
    NCCL. `measured` says where the thresholds come from."""

    one_shot_max_bytes: int
    two_shot_max_bytes: int
    measured: str = ""
    push_max_bytes: int = 0
    push_kernel: str = "push"
    fused_max_bytes: int = 0  # the fused one-row all-reduce's largest row (fused.py; OpChoices.fuse_all_reduce)

    def __post_init__(self):
        if not 0 <= self.one_shot_max_bytes <= self.two_shot_max_bytes:
            raise ValueError(
                f"AllReduceRule(one_shot_max_bytes={self.one_shot_max_bytes}, two_shot_max_bytes="
                f"{self.two_shot_max_bytes}): need 0 <= one_shot_max_bytes <= two_shot_max_bytes"
            )
        if self.push_max_bytes < 0 or self.push_max_bytes % ALIGN:
            raise ValueError(f"AllReduceRule(push_max_bytes={self.push_max_bytes}): need a multiple of {ALIGN} >= 0")
        fused = self.fused_max_bytes
        if fused < 0 or fused % ALIGN or (fused and not self.push_max_bytes):
            raise ValueError(f"AllReduceRule(fused_max_bytes={self.fused_max_bytes}): need a multiple of {ALIGN} >= 0, "
                             "and a push region (push_max_bytes) to lie in")  # fmt: skip
        if self.push_kernel not in PUSH_KINDS:
            raise ValueError(f"AllReduceRule(push_kernel={self.push_kernel!r}): choose one of {list(PUSH_KINDS)}")

    def push_layout(self, world_size: int) -> PushLayout | None:
        """Where the push kernel's data and flags lie in the symmetric buffer: after torch's kernels' region."""
        if not self.push_max_bytes:
            return None
        offset = -(-self.two_shot_max_bytes // ALIGN) * ALIGN
        return PushLayout(world_size, self.push_max_bytes, offset=offset, fused_bytes=self.fused_max_bytes)

    def buffer_bytes(self, world_size: int) -> int:
        """The symmetric buffer the rule needs: torch's kernels' largest message, then the push kernel's region."""
        layout = self.push_layout(world_size)
        return layout.end if layout else self.two_shot_max_bytes


# world size -> rule; measured with `torchrun --nproc-per-node N scripts/bench_tp.py --sweep` (docs/performance.md).
RULES: dict[int, AllReduceRule] = {
    # 2 x H100 (NV18), 2026-11-28, bf16, 16 all-reduces per CUDA graph: our lamport kernel the fastest from 2 KiB to
    # 8 MiB (4.2-5.6 us up to 256 KiB against NCCL 8.0-11.4, our push kernel 6.9-7.9, torch's one-shot 9.8-12.8;
    # 1 MiB 8.2 against 17.8; 8 MiB 35.2 against two-shot 48.6 and NCCL 57.7); in the 8B TP 2 step 3.89 us a call
    # (torch's one-shot 12.89). Torch's kernels are nowhere faster there (on 2 x H200, 2026-11-27, before ours:
    # one-shot up to 1 MiB, two-shot to 8 MiB); above 8 MiB not measured: NCCL.
    # fused_max_bytes: a row of hidden 16384 in float32 (8B: 8 KiB), 768 KiB more a GPU; used only with
    # OpChoices.fuse_all_reduce (on by default: 0-40 us a step faster, 8B TP 2 batch 1 on 2 x H200, 2026-11-28)
    2: AllReduceRule(
        0,
        0,
        "measured on 2 x H100 NV18, 2026-11-28",
        push_max_bytes=8 << 20,
        push_kernel="lamport",
        fused_max_bytes=64 << 10,
    ),  # fmt: skip
}


def choose_kernel(nbytes: int, dtype: torch.dtype, world_size: int, rules: dict[int, AllReduceRule] = RULES) -> str:
    """The kernel ("push", "lamport", "one_shot", "two_shot" or "nccl") summing `nbytes` bytes of `dtype` over
    `world_size` ranks."""
    rule = rules.get(world_size)
    if rule is None or nbytes % 4 or nbytes == 0:
        return "nccl"
    if nbytes <= rule.push_max_bytes and dtype in PUSH_DTYPES:
        return rule.push_kernel
    if dtype not in PEER_DTYPES:
        return "nccl"
    if nbytes <= rule.one_shot_max_bytes:
        return "one_shot"
    return "two_shot" if nbytes <= rule.two_shot_max_bytes else "nccl"


@dataclass(frozen=True)
class PeerInfo:
    """One rank's place for peer memory: its host, its CUDA device and the devices of that host it can reach."""

    rank: int
    host: str
    device: int
    reaches: tuple[int, ...]

    @classmethod
    def here(cls, rank: int, device: int) -> PeerInfo:
        n = torch.cuda.device_count()
        reaches = tuple(d for d in range(n) if d != device and torch.cuda.can_device_access_peer(device, d))
        return cls(rank, socket.gethostname(), device, reaches)


def peer_access_refusal(infos: list[PeerInfo], world_size: int, rules: dict[int, AllReduceRule] = RULES) -> str:
    """Why a group of ranks `infos` cannot use peer memory ("" when it can). Every rank computes this from the
    same gathered list, so all ranks decide alike."""
    if world_size not in rules:
        return f"no measured all-reduce rule for {world_size} ranks (measured: {sorted(rules)})"
    hosts = sorted({i.host for i in infos})
    if len(hosts) > 1:
        return f"the group spans hosts {hosts}; peer memory needs every rank on one host"
    for a in infos:
        for b in infos:
            if a.rank != b.rank and b.device not in a.reaches:
                return (
                    f"rank {a.rank} (cuda:{a.device}) cannot access the memory of rank {b.rank} (cuda:{b.device}): "
                    "no CUDA peer-to-peer access between them (PCIe without P2P, or P2P disabled)"
                )
    return ""


class PeerAllReduce:
    """A group's symmetric buffer and rule: `all_reduce(x)` sums x over the group by peer memory, or returns
    None when the rule gives the message to NCCL."""

    def __init__(self, group: Any, buffer: torch.Tensor, rule: AllReduceRule, push: PushAllReduce | None = None):
        self.group, self.buffer, self.rule = group, buffer, rule  # buffer: uint8 [rule.buffer_bytes(world)]
        self.push = push  # the push kernel's state over the buffer (one per buffer: share it, never copy it)
        self.group_name = group.group_name
        self.world_size = group.size()
        self.calls = {k: 0 for k in KERNELS}  # eager calls and captures by kernel (replays are not counted)
        self.calls["fused"] = 0  # fused one-row all-reduces (fused.py's reader op), counted alike

    @classmethod
    def setup(cls, group: Any, rank: int, device: int, rules: dict[int, AllReduceRule] = RULES) -> PeerAllReduce | None:
        """Collective over `group` (every rank calls it): the group's PeerAllReduce, or None (logged, naming
        why) when its ranks cannot use peer memory."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        infos: list = [None] * group.size()
        dist.all_gather_object(infos, PeerInfo.here(rank, device), group=group)
        why = peer_access_refusal(infos, group.size(), rules)
        if why:
            log.warning("all-reduce over %d ranks: peer memory refused (%s); every all-reduce uses NCCL",
                        group.size(), why)  # fmt: skip
            return None
        rule = rules[group.size()]
        cuda = torch.device("cuda", device)
        layout = rule.push_layout(group.size())
        try:  # this rank's share of the symmetric buffer (the driver's virtual-memory and IPC calls)
            buffer, error = symm_mem.empty(rule.buffer_bytes(group.size()), dtype=torch.uint8, device=cuda), ""
            if layout:  # our kernels' flags and rows at epoch 0 before any peer can write them (the rendezvous below)
                prepare(buffer, layout)
            torch.cuda.synchronize(cuda)
        except Exception as e:  # noqa: BLE001 - refused below on every rank alike, named
            buffer, error = None, f"{type(e).__name__}: {e}"
        errors: list = [None] * group.size()
        dist.all_gather_object(errors, error, group=group)  # every rank decides alike before the rendezvous
        failed = {r: e for r, e in enumerate(errors) if e}
        if not failed:
            try:  # collective: every rank gets here
                handle = symm_mem.rendezvous(buffer, group.group_name)
                push, error = PushAllReduce(layout, rank, buffer, list(handle.buffer_ptrs)) if layout else None, ""
            except Exception as e:  # noqa: BLE001 - refused below, named
                error = f"rendezvous: {type(e).__name__}: {e}"
            # and every rank decides alike after it: one rank on NCCL while its peers wait in our kernels would hang
            dist.all_gather_object(errors, error, group=group)
            failed = {r: e for r, e in enumerate(errors) if e}
        if failed:
            log.warning("all-reduce over %d ranks: peer memory refused (symmetric memory failed on rank(s) %s); "
                        "every all-reduce uses NCCL", group.size(), failed)  # fmt: skip
            return None
        log.info(
            "all-reduce over %d ranks: peer memory (symmetric memory) %s up to %d KiB, one-shot up to %d KiB, "
            "two-shot up to %d KiB, NCCL above (%s)", group.size(), rule.push_kernel, rule.push_max_bytes // 1024,
            rule.one_shot_max_bytes // 1024, rule.two_shot_max_bytes // 1024, rule.measured,
        )  # fmt: skip
        return cls(group, buffer, rule, push)

    def kernel_for(self, x: torch.Tensor) -> str:
        kernel = choose_kernel(x.numel() * x.element_size(), x.dtype, self.world_size, {self.world_size: self.rule})
        if kernel in PUSH_KINDS and (self.push is None or not self.push.fits(x)):
            return "nccl"  # a rule larger than the buffer's push region (a forced rule sharing another's buffer)
        return kernel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the group (a new tensor), or None: the rule gives this message to NCCL."""
        kernel = self.kernel_for(x)
        if kernel == "nccl" or x.device != self.buffer.device:
            return None
        self.calls[kernel] += 1
        src = x.contiguous()
        if (src.storage_offset() * src.element_size()) % 16:  # the kernel wants the buffer's alignment
            src = src.clone()
        if kernel in PUSH_KINDS:  # store into every peer, wait for theirs, sum locally: one kernel
            return self.push.all_reduce(src, kernel)
        symm = self.buffer.view(x.dtype)[: src.numel()].view(src.shape)
        if kernel == "one_shot":  # copy in, barrier, sum every rank's buffer into a fresh tensor: one kernel
            return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, src, "sum", self.group_name)
        symm.copy_(src)
        out = torch.empty_like(src)
        return torch.ops.symm_mem.two_shot_all_reduce_out(symm, "sum", self.group_name, out)


_PEER: dict[str, PeerAllReduce] = {}


def register_peer(name: str, peer: PeerAllReduce) -> None:
    """Make the op's all-reduces over the group registered as `name` use `peer`'s kernels where its rule says."""
    _PEER[name] = peer


def unregister_peer(name: str) -> None:
    _PEER.pop(name, None)


def peer_for(name: str) -> PeerAllReduce | None:
    return _PEER.get(name)
