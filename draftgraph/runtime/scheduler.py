"""Continuous batching: which requests run this step, and how many tokens each.

Every decoding request verifies its last token plus K drafts (K+1 tokens, or 1 without a drafter).
Prompts are prefilled in chunks from what is left of the token budget: first the prompts already in
progress, then new arrivals in order. A request is admitted only when a slot is free and its worst-case
KV blocks (prompt + max_tokens + draft lookahead) can be allocated, so a running request never waits
for memory (no preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable
from draftgraph.runtime.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    req: Request
    num_tokens: int
    last: bool  # this chunk finishes the prompt: the step samples the request's next token


@dataclass(frozen=True)
class ScheduledBatch:
    decodes: list[Request]  # each verifies 1 + K tokens
    prefills: list[ScheduledChunk]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int,
        allocator: BlockAllocator,
        block_size: int,
        lookahead: int,
    ):
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.k = num_speculative_tokens
        self.allocator = allocator
        self.block_size = block_size
        self.lookahead = lookahead  # KV positions a decode step may write past the accepted tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        decodes = [r for r in self.running if not r.prefilling]
        budget = self.budget - len(decodes) * (self.k + 1)
        prefills = []
        for r in self.running:
            if r.prefilling and budget > 0:
                prefills.append(self._chunk(r, budget))
                budget -= prefills[-1].num_tokens
        while self.waiting and budget > 0 and self._free_slots and self._try_admit(self.waiting[0]):
            r = self.waiting.popleft()
            self.running.append(r)
            prefills.append(self._chunk(r, budget))
            budget -= prefills[-1].num_tokens
        return ScheduledBatch(decodes, prefills)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        req.block_table.release()
        self._free_slots.append(req.slot)
        req.slot = -1

    def _chunk(self, r: Request, budget: int) -> ScheduledChunk:
        n = min(r.prefill_len - r.num_computed, budget)
        return ScheduledChunk(r, n, r.num_computed + n == r.prefill_len)

    def _try_admit(self, r: Request) -> bool:
        need = len(r.prompt) + r.params.max_tokens + self.lookahead
        blocks = -(-need // self.block_size)
        if blocks > self.allocator.num_free:
            if not self.running:
                raise RuntimeError(
                    f"request {r.id} needs {blocks} KV blocks (prompt {len(r.prompt)} + max_tokens "
                    f"{r.params.max_tokens} + lookahead {self.lookahead}) but the cache has only "
                    f"{self.allocator.num_blocks}; raise num_kv_blocks or lower max_tokens"
                )
            return False
        r.block_table = BlockTable(self.allocator, self.block_size)
        r.block_table.ensure_capacity(need)
        r.slot = self._free_slots.pop()
        return True
