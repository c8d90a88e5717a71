"""Continuous batching: which requests run this step, how many tokens each, and their KV blocks.

Every decoding request verifies its last token plus K drafts (K+1 tokens, or 1 without a drafter).
Prompts are prefilled in chunks from what is left of the token budget: first the prompts already in
progress, then new arrivals in order.

KV blocks are allocated as sequences grow: before each step, every scheduled request gets the blocks this
step may write (runtime/step_writes.py holds that worst case), a new arrival only those of its first
chunk. When the cache runs out, the most recently admitted running requests not yet scheduled this step
are preempted (vLLM's policy): their blocks are freed and they go back to the front of the waiting queue,
to be recomputed (their generated tokens prefilled after the prompt). A request preempted while decoding
keeps its last token and pending drafts, and its slot (the device buffers holding the drafts' sampling
probabilities are indexed by it): its recomputation ends without sampling, and its next step verifies
exactly the drafts it would have verified, so no output is lost, duplicated or changed. No new request is
admitted in a step that preempted.

Prefix caching (runtime/prefix_cache.py): a request admitted from the waiting queue (new, or to be recomputed)
first looks its tokens up; the cached blocks found start its block table and its prefill starts after them.
Running requests register their blocks as they become final (at each schedule, and when they finish or are
preempted), so a preempted request usually finds most of its own blocks again. Hybrid models (`snapshots`,
runtime/state_snapshots.py): a hit also needs a state snapshot at its end (the hit is cut to the last one), its
first block is a private copy, and prefill chunks end at the block boundaries where snapshots are wanted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable
from draftgraph.runtime.prefix_cache import PrefixCacheStats, PrefixKey
from draftgraph.runtime.request import Request
from draftgraph.runtime.step_writes import StepWrites

if TYPE_CHECKING:  # (state_snapshots.py imports state_cache.py, which imports this module)
    from draftgraph.runtime.state_snapshots import StateSnapshots


@dataclass(frozen=True)
class ScheduledChunk:
    req: Request
    num_tokens: int
    # This chunk finishes the prompt and the step samples the request's next token (False for the last chunk
    # of a preempted decode's recomputation: its next token and drafts are known already).
    last: bool
    # The request's first chunk since it was admitted (new, or recomputed after a preemption): its per-slot state
    # (penalties, linear-attention rows) is written before the step. It starts after any cached prefix.
    first: bool = False
    # Hybrid prefix hit (runtime/state_snapshots.py): the chain hash of the state snapshot at the chunk's start, and
    # the cached block whose KV the request's private first block copies.
    restore: bytes | None = None
    copy_first: int = -1


@dataclass(frozen=True)
class ScheduledBatch:
    decodes: list[Request]  # each verifies 1 + K tokens
    prefills: list[ScheduledChunk]
    num_preempted: int = 0  # requests preempted while scheduling this batch

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        allocator: BlockAllocator,
        block_size: int,
        writes: StepWrites,
        prefix: PrefixKey | None = None,  # prefix caching on: how blocks are named
        snapshots: StateSnapshots | None = None,  # hybrid prefix caching: the state snapshots' index
    ):
        self.prefix, self.snapshots = prefix, snapshots
        self.reset_stats()
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.allocator = allocator
        self.block_size = block_size
        self.writes = writes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def reset_stats(self) -> None:
        """Count prefix-cache lookups afresh (Engine.reset_stats)."""
        self.prefix_stats = PrefixCacheStats(enabled=self.prefix is not None)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that could not run even alone in the cache."""
        slots = self.writes.lifetime_slots(prompt_len, max_tokens)
        blocks = -(-slots // self.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(
                f"a request of {prompt_len} prompt tokens and max_tokens={max_tokens} needs {blocks} KV blocks of "
                f"{self.block_size} tokens ({slots} positions with the speculative lookahead) at its longest, but "
                f"the cache has {self.allocator.num_blocks}; raise CompileConfig.num_kv_blocks (or "
                f"gpu_memory_utilization), or shorten the prompt / lower max_tokens"
            )

    def add(self, req: Request) -> None:
        self.check_fits(len(req.prompt), req.params.max_tokens)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        scheduled: set[int] = set()  # id() of requests given their blocks this step
        preempted: set[int] = set()
        budget = self.budget
        decodes = []
        for r in self.running:
            self._register(r)
        for r in list(self.running):
            if r.prefilling or id(r) in preempted:
                continue
            if self._grow(r, self.writes.slots(r.num_computed, self.writes.decode_rows, True), scheduled, preempted):
                decodes.append(r)
                budget -= self.writes.decode_rows
        prefills = []
        for r in list(self.running):  # requests preempted above have left the list
            if budget <= 0:
                break
            if not r.prefilling or id(r) in scheduled or id(r) in preempted:
                continue
            n, samples = self._chunk_size(r, budget)
            if self._grow(r, self.writes.slots(r.num_computed, n, samples), scheduled, preempted):
                prefills.append(ScheduledChunk(r, n, samples))
                budget -= n
        while not preempted and self.waiting and budget > 0:
            r = self.waiting[0]
            if r.slot < 0 and not self._free_slots:
                break
            table = r.block_table or BlockTable(self.allocator, self.block_size)
            hits = self._lookup(r, table)  # r.num_computed is 0 here: new, or preempted
            start = len(hits) * self.block_size
            n, samples = self._chunk_size(r, budget, start)
            slots = self.writes.slots(start, n, samples)
            private = self.snapshots is not None and bool(hits)  # a hybrid hit's first block: a copy, not shared
            shared = hits[1:] if private else hits
            # sharing cached blocks nobody holds takes them off the free count too
            if table.blocks_needed(slots) - len(shared) > self.allocator.num_free - self.allocator.num_unheld(shared):
                break  # running requests are never preempted for a new one
            if self.prefix is not None:
                self.prefix_stats.record(r.prefill_len, self.block_size, len(hits))
            r.block_table = table
            table.adopt(hits, private_first=private)
            r.num_computed = start
            # a cached block without a draft model's entries (runtime/prefix_cache.py): caught up from there
            written = table.num_draft_written * self.block_size
            r.draft_lag = written if written < start else -1
            table.ensure_capacity(slots)
            if r.slot < 0:
                r.slot = self._free_slots.pop()
            self.running.append(self.waiting.popleft())
            restore = table.hashes[len(hits) - 1] if private else None  # the snapshot at the hit's end
            prefills.append(ScheduledChunk(r, n, samples, True, restore, hits[0] if private else -1))
            budget -= n
        self.prefix_stats.prefill_tokens += sum(c.num_tokens for c in prefills)
        return ScheduledBatch(decodes, prefills, len(preempted))

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self._register(req)
        req.block_table.release()
        self._free_slots.append(req.slot)
        req.slot = -1

    def _chunk_size(self, r: Request, budget: int, start: int | None = None) -> tuple[int, bool]:
        """Tokens of r's prompt to prefill now from `start` (r.num_computed by default), and whether the step
        then samples its next token."""
        start = r.num_computed if start is None else start
        n = min(r.prefill_len - start, budget)
        if self.snapshots is not None:  # end at the first boundary inside where a snapshot is wanted
            bs = self.block_size
            for cut in sorted((r.state_cut, (r.prefill_len - 1) // bs * bs)):
                if start < cut < start + n:
                    n = cut - start
                    break
        return n, start + n == r.prefill_len and not r.resumes_decode

    def _lookup(self, r: Request, table: BlockTable) -> list[int]:
        """The cached blocks r's prefill may start from (none without prefix caching): the longest cached chain of
        its tokens' full blocks, short of its last prefill token; for a hybrid model, short of the last block that
        ends at a state snapshot (and the prefill then leaves one at the blocks' end: `state_cut`)."""
        if self.prefix is None:
            return []
        limit = self.prefix.max_hit_blocks(r.prefill_len)
        hashes = self.prefix.extend(table.hashes, r.tokens, limit)[:limit]
        hits = self.allocator.lookup(hashes)
        if self.snapshots is None:
            return hits
        m = self.snapshots.longest(hashes, len(hits))
        r.state_cut = len(hits) * self.block_size if m < len(hits) else 0
        return hits[:m]

    def _register(self, r: Request) -> None:
        """Register r's blocks that became final (runtime/prefix_cache.py: every position < num_computed is an
        accepted token in every cache, and a block's hash reads `lookahead` tokens past it); those past where a draft
        model's KV lags (adaptive speculation's K = 0 steps skipped it: `draft_lag`) as missing its entries, and
        marked written once it caught up."""
        if self.prefix is None or r.block_table is None:
            return
        table, bs = r.block_table, self.block_size
        written = r.num_computed if r.draft_lag < 0 else min(r.num_computed, r.draft_lag)
        full = min(r.num_computed // bs, len(table.blocks))
        blocks = table.blocks
        if full > table.num_registered:
            hashes = self.prefix.extend(table.hashes, r.tokens, full)
            full = min(full, len(hashes))
            for i in range(table.num_registered, full):
                self.allocator.register(int(blocks[i]), hashes[i], draft_missing=(i + 1) * bs > written)
            table.num_registered = max(table.num_registered, full)
        done = min(written // bs, table.num_registered)
        for i in range(table.num_draft_written, done):
            self.allocator.draft_written(int(blocks[i]))
        table.num_draft_written = max(table.num_draft_written, done)

    def _grow(self, r: Request, slots: int, scheduled: set[int], preempted: set[int]) -> bool:
        """Give r blocks for `slots` positions, preempting the latest admitted running requests not scheduled
        this step while the cache is short; False when r itself had to go."""
        need = r.block_table.blocks_needed(slots)
        while need > self.allocator.num_free:
            # r is running and unscheduled, so there is always a victim: r itself at the latest.
            victim = next(v for v in reversed(self.running) if id(v) not in scheduled)
            self._preempt(victim)
            preempted.add(id(victim))
            if victim is r:
                return False
        r.block_table.ensure_capacity(slots)
        scheduled.add(id(r))
        return True

    def _preempt(self, r: Request) -> None:
        """Free r's blocks and put it at the front of the waiting queue for recomputation; it keeps its slot."""
        self.running.remove(r)
        self._register(r)
        r.block_table.release()
        if not r.prefilling:  # decoding: recompute all but the last token, which the next verify feeds
            r.prefill_len = len(r.tokens) - 1
            r.resumes_decode = True
        r.num_computed = 0
        self.waiting.appendleft(r)
