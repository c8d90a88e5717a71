"""Per-request recurrent state of Gated DeltaNet layers (Qwen3.5), beside the paged KV cache.

Layout, per linear layer of a model (ops/linear_attention/op.py states the contract the op reads):
- conv_states [R, Lc, conv_dim] in the model dtype: a ring of the conv's inputs by position (p at p % Lc);
- ssm_states [R, L, HV, Dk, Dv] float32: a ring of the states after each position (p at p % L);
- block_rows [num_blocks] int32 (one per cache, shared by its layers): the state row of the request whose
  FIRST KV block is that block.
R = max_num_seqs + 1: row = the request's slot (`Request.slot`, kept while it runs or waits preempted,
freed with it); the last row is scratch. L = K + 1 for a target, K + 2 for a draft model (the op's docstring
says why), Lc = L + conv_kernel - 2.

Why a block -> row map: a forward sees only the attention metadata, whose block tables start with each
request's first block, unique to it while it lives (a prefix-cache hit's first block is a private copy of the cached
one: runtime/state_snapshots.py). The engine writes the map when a request is admitted
(its first prefill chunk: new blocks, also after a preemption), a tiny copy outside any graph; steps then
find rows on the device. Nothing is reset between requests: a forward from position 0 starts from zeros.
Rollback needs nothing here: the op reads the state by position (the op's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.runtime.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StateCacheSpec:
    layers: tuple[int, ...]  # the model's linear-attention layers
    num_rows: int  # max_num_seqs + 1 (the last row is scratch)
    ring: int  # L: states kept per request
    conv_ring: int  # Lc: conv inputs kept per request
    conv_dim: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype: torch.dtype  # of the conv inputs (the model's); states are float32

    @classmethod
    def for_model(cls, cfg, layers: tuple[int, ...], max_num_seqs: int, ring: int) -> StateCacheSpec:
        la = cfg.hybrid.linear
        return cls(layers, max_num_seqs + 1, ring, ring + la.conv_kernel - 2, la.conv_dim, la.num_v_heads,
                   la.head_k_dim, la.head_v_dim, cfg.dtype)  # fmt: skip

    @property
    def bytes(self) -> int:
        """Device bytes of every layer's rings (the block map aside)."""
        conv = self.conv_ring * self.conv_dim * torch.finfo(self.dtype).bits // 8
        ssm = self.ring * self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
        return len(self.layers) * self.num_rows * (conv + ssm)


class StateCache:
    """`reserve_blocks` > 0: the block map is a map of that many blocks, so that a KV cache growing in place
    (kv_cache.py) keeps its address and size too."""

    def __init__(self, spec: StateCacheSpec, num_blocks: int, device, reserve_blocks: int = 0):
        self.spec, self.device = spec, torch.device(device)
        self._rows_reserved = (
            torch.zeros(max(reserve_blocks, num_blocks), dtype=torch.int32, device=self.device)
            if reserve_blocks
            else None
        )
        s = spec
        self.conv = {
            i: torch.zeros(s.num_rows, s.conv_ring, s.conv_dim, dtype=s.dtype, device=self.device) for i in s.layers
        }
        self.ssm = {
            i: torch.zeros(s.num_rows, s.ring, s.num_v_heads, s.head_k_dim, s.head_v_dim, device=self.device)
            for i in s.layers
        }
        self.resize_blocks(num_blocks)

    def resize_blocks(self, num_blocks: int) -> None:
        """A new block map for a cache of `num_blocks` blocks (while no request runs)."""
        from torch._dynamo.decorators import maybe_mark_dynamic  # as kv_cache.py: the block count is dynamic

        if self._rows_reserved is not None:  # the whole map, not a view of num_blocks: graphs captured before the
            # cache grew keep reading it, and compiled code checks a gather's index against the size it was given
            # (a view of the probe's size failed that check once block ids passed it: a device-side assert)
            self._rows_reserved.zero_()
            self.block_rows = self._rows_reserved
        else:
            self.block_rows = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)
        maybe_mark_dynamic(self.block_rows, 0)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.conv[i], self.ssm[i], self.block_rows


class StateSlots:
    """The engine's hook: maps newly admitted requests' first blocks to their rows in every state cache."""

    def __init__(self, caches: list[StateCache]):
        self.caches = caches

    def admit(self, chunks: list[ScheduledChunk]) -> None:
        """Before a step: each request just admitted (new, or recomputed) gets its row: its first block is its own
        (a prefix-cache hit's is a private copy: runtime/state_snapshots.py, which also restores the state)."""
        firsts = [(c.req.block_table.blocks[0], c.req.slot) for c in chunks if c.first]
        if not firsts:
            return
        blocks, rows = zip(*firsts)
        for cache in self.caches:
            dev = cache.block_rows.device
            idx = torch.tensor(blocks, dtype=torch.long).to(dev, non_blocking=True)
            cache.block_rows[idx] = torch.tensor(rows, dtype=torch.int32).to(dev, non_blocking=True)


def attach_state_caches(runner, max_num_seqs: int, k: int) -> StateSlots | None:
    """Give the linear layers of `runner`'s target (and draft model) caches their state tensors, in place
    (before anything traces them); None when no model has linear layers."""
    pairs = [(runner.target_cache, runner.target.cfg, k + 1)]
    if runner.drafter is not None:
        pairs.append((runner.draft_cache, runner.drafter.cfg, k + 2))  # a draft model's rounds reach 1 further
    caches = []
    for cache, cfg, ring in pairs:
        layers = cache.spec.linear_layers
        if not layers:
            continue
        cache.state = StateCache(StateCacheSpec.for_model(cfg, layers, max_num_seqs, ring), cache.spec.num_blocks,
                                 cache.device, cache.reserve_blocks)  # fmt: skip
        for i in layers:
            cache.layers[i] = cache.state.layer(i)
        caches.append(cache.state)
    return StateSlots(caches) if caches else None
