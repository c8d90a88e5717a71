"""Prefix caching for hybrid models (Qwen3.5): snapshots of the Gated DeltaNet state at block boundaries.

A cached prefix of h tokens needs, besides its KV blocks (runtime/prefix_cache.py), every linear layer's state
after position h - 1: the recurrent state and the conv's last W - 1 inputs. The rings of runtime/state_cache.py
keep only a request's last L positions, so the state at a boundary is copied out into a snapshot slot right after
a forward ends there, and copied back into a later request's ring row (at the entries the op reads for a forward
starting at h: ops/linear_attention/op.py) before its first chunk runs.

What is kept. A fixed pool of `prefix_state_snapshots` slots (CompileConfig; auto: max_num_seqs), allocated once
beside the rings (never reallocated: graphs never read it, only copies outside them do), per linear layer of the
target: conv [S, W-1, conv_dim] in the model dtype and ssm [S, HV, Dk, Dv] float32. Bytes per snapshot =
linear layers x ((W-1) x conv_dim x dtype bytes + HV x Dk x Dv x 4) (`bytes_per_snapshot`, in stats()); the
Qwen3.5-shaped 1B of scripts/bench_qwen3_5.py (12 GDN layers, HV 16, Dk = Dv = 128, conv_dim 6144, W 4, bf16):
12 x (36,864 + 1,048,576) B = 13.0 MB (12.4 MiB) per snapshot, the recurrent state 97 % of it; the auto pool
(max_num_seqs slots) costs 1/L of the per-request rings (L = K + 1 states per request and layer).

Which boundaries. A snapshot is named by the chain hash of the block that ends at its boundary e (a multiple of
the block size B), so it is found with the blocks; it is taken when a prefill chunk ends exactly at e (the ring
then holds the state after e - 1 in every layer). The scheduler ends chunks at (runtime/scheduler.py):
* the prompt's last full-block boundary short of its last token, ((prefill_len - 1) // B) * B: the longest hit a
  later request with this prompt (or one extending it, as a next chat turn) can have;
* the cached blocks' end when a lookup found more blocks than snapshots (a new request diverging from a cached
  prompt inside it, e.g. a shared system prompt followed by different questions): the first such request
  recomputes from the longest snapshot and leaves one at the divergence point, so the next ones hit it all;
* any chunk that ends on a boundary anyway (the token budget) leaves a snapshot too.
Generated tokens are not snapshotted (a next turn hits up to its prompt's snapshots). The first cut costs a prompt
that would have fit one step a second step before its first token (its last partial block alone); prefix caching
off (CompileConfig.prefix_caching) avoids it where prompts never repeat.

A hit needs both: the lookup's blocks are cut to the longest prefix that ends at a snapshot. The request's first
block, shared with the cached prompt, would map two requests to one state row (state_cache.py maps a request's
FIRST block to its row), so a hybrid hit copies that block's KV into a private first block instead of sharing it
(one block per attention layer, before the step). Snapshots are least recently used out when the pool is full,
first those whose block left the cache; an evicted snapshot only shortens later hits (nothing is lost). Only the
target's state is snapshotted: a draft model with linear layers turns prefix caching off (`hybrid_support`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from draftgraph.runtime.state_cache import StateCache


def hybrid_support(runner, states) -> str:
    """Why prefix caching cannot run for this pair ("" when it can): a drafter that keeps linear-attention state."""
    if states is not None and runner.drafter is not None and getattr(runner.draft_cache, "state", None) is not None:
        return (
            "the draft model has Gated DeltaNet layers too, and only the target's state is snapshotted at block "
            "boundaries (runtime/state_snapshots.py)"
        )
    return ""


class StateSnapshots:
    """The snapshot pool of one state cache (the target's) and its index: chain hash -> slot, LRU order."""

    def __init__(self, cache: StateCache, num_slots: int, kv_caches: list):
        self.cache, self.num_slots, self.kv_caches = cache, num_slots, kv_caches
        s = cache.spec
        self.width = s.conv_ring - s.ring + 1  # W - 1 conv inputs before a forward's first position
        dev = cache.device
        self.conv = {i: torch.zeros(num_slots, self.width, s.conv_dim, dtype=s.dtype, device=dev) for i in s.layers}
        self.ssm = {i: torch.zeros(num_slots, s.num_v_heads, s.head_k_dim, s.head_v_dim, device=dev) for i in s.layers}
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self.taken = self.restored = self.evictions = 0

    @staticmethod
    def bytes_per_snapshot(spec) -> int:
        conv = (spec.conv_ring - spec.ring + 1) * spec.conv_dim * torch.finfo(spec.dtype).bits // 8
        return len(spec.layers) * (conv + spec.num_v_heads * spec.head_k_dim * spec.head_v_dim * 4)

    # ---- the host index (the scheduler's) ------------------------------------------------------------

    def longest(self, hashes: list[bytes], n: int) -> int:
        """The most of the first `n` blocks of a chain that end at a snapshot (0: none)."""
        for m in range(n, 0, -1):
            if hashes[m - 1] in self._slot_of:
                return m
        return 0

    def clear(self) -> None:
        """Forget every snapshot (the KV cache was rebuilt: no block they belong to is left)."""
        self._slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def stats(self) -> dict:
        return {
            "slots": self.num_slots,
            "used": len(self._slot_of),
            "taken": self.taken,  # since the engine was built, as `restored` and `evictions`
            "restored": self.restored,
            "evictions": self.evictions,
            "bytes_per_snapshot": self.bytes_per_snapshot(self.cache.spec),
        }

    # ---- device copies (outside every graph, on the step's stream) ----------------------------------------

    def _index(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.cache.device, non_blocking=True)

    def _entries(self, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For forwards starting at each position e: the ssm ring entry they read [n] and the conv ring's [n, W-1]."""
        s = self.cache.spec
        conv = [[(e - self.width + j) % s.conv_ring for j in range(self.width)] for e in ends]
        return self._index([(e - 1) % s.ring for e in ends]), self._index(conv)

    def admit(self, chunks) -> None:
        """Before a step: each admitted request that hit a cached prefix gets its private first block's KV and its
        state at the prefix's end (ScheduledChunk.copy_first / .restore)."""
        hits = [c for c in chunks if c.first and c.restore is not None]
        if not hits:
            return
        src, dst = (
            self._index([c.copy_first for c in hits]),
            self._index([int(c.req.block_table.blocks[0]) for c in hits]),
        )
        for kv in self.kv_caches:
            for i, layer in enumerate(kv.layers):
                for t in layer if i not in kv.spec.linear_layers else ():
                    t[dst] = t[src]
        slots = []
        for c in hits:
            slots.append(self._slot_of[c.restore])
            self._slot_of.move_to_end(c.restore)
        slots_t, rows = self._index(slots), self._index([c.req.slot for c in hits])
        ssm_e, conv_e = self._entries([c.req.num_computed for c in hits])
        for i in self.cache.spec.layers:
            self.cache.ssm[i][rows, ssm_e] = self.ssm[i][slots_t]
            self.cache.conv[i][rows[:, None], conv_e] = self.conv[i][slots_t]
        self.restored += len(hits)

    def take(self, ends: list[tuple[int, int, bytes]], alive) -> None:
        """After a step: copy the state at each (row, boundary, chain hash) whose forward just ended there into a
        slot, unless that hash has one; a full pool drops first snapshots whose block left the cache (`alive(h)`
        False), then the least recently used."""
        new, seen = [], set()
        for row, end, h in ends:
            if h in self._slot_of:
                self._slot_of.move_to_end(h)
            elif h not in seen:
                seen.add(h)
                new.append((row, end, h))
        new = new[len(new) - self.num_slots :] if self.num_slots else []  # a slot is written once per call
        if not new:
            return
        if len(self._free) < len(new):
            for h in [h for h in self._slot_of if not alive(h)]:
                self._free.append(self._slot_of.pop(h))
        slots = []
        for _, _, h in new:
            if not self._free:
                self._free.append(self._slot_of.popitem(last=False)[1])
                self.evictions += 1
            slots.append(self._free.pop())
            self._slot_of[h] = slots[-1]
        slots_t, rows = self._index(slots), self._index([r for r, _, _ in new])
        ssm_e, conv_e = self._entries([e for _, e, _ in new])
        for i in self.cache.spec.layers:
            self.ssm[i][slots_t] = self.cache.ssm[i][rows, ssm_e]
            self.conv[i][slots_t] = self.cache.conv[i][rows[:, None], conv_e]
        self.taken += len(new)


def make_snapshots(runner, states, rc) -> tuple[StateSnapshots | None, str]:
    """The target's snapshot pool when prefix caching is on for a hybrid model, and why not otherwise ("" when
    there is nothing to say: no linear layers, or prefix caching asked off)."""
    if states is None or not rc.prefix_caching:
        return None, ""
    why = hybrid_support(runner, states)
    if why:
        return None, why
    kv = [runner.target_cache] + ([runner.draft_cache] if runner.drafter is not None else [])
    return StateSnapshots(runner.target_cache.state, rc.prefix_state_snapshots, kv), ""
