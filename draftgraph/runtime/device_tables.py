"""Block tables kept on the device per request slot, updated in place as requests grow.

The host builder (attn_metadata.py) writes every request's whole block-table row into a pinned buffer and
sends it every step. A uniform decode step only ever appends: a request gains a block every block_size /
(accepted + 1) steps. `DeviceTables` keeps one row per request slot (runtime/scheduler.py gives each running
request one) plus a scratch row for padding, remembers how much of each row the device holds, and writes only
what changed; one asynchronous copy sends the host mirror when anything did. The one-graph step reads the
rows by slot (ops/attention/uniform_metadata.py).

A row is rewritten whole when its slot has a new owner (another request, or the same request's table after
preemption released it), and `invalidate()` forgets everything (after a step that did not go through here).
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceTables:
    """Per-slot block tables [max_slots + 1, max_blocks] int32 on the device; row `max_slots` is all zeros."""

    def __init__(self, max_slots: int, max_blocks: int, device):
        self.device = torch.device(device)
        self.scratch = max_slots
        pin = self.device.type == "cuda"
        self._host = torch.zeros(max_slots + 1, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._np = self._host.numpy()
        self.tables = torch.zeros(max_slots + 1, max_blocks, dtype=torch.int32, device=self.device)
        self._owner: list[object | None] = [None] * max_slots  # the BlockTable each row mirrors
        self._held = np.zeros(max_slots, dtype=np.int64)  # blocks of it the row holds
        self.uploads = 0  # copies sent (a step with nothing new sends none)

    def invalidate(self) -> None:
        self._owner = [None] * len(self._owner)

    def update(self, reqs) -> None:
        """Bring the rows of `reqs` (Requests with a slot and a block_table) up to date; one copy if any changed.
        The pinned mirror is rewritten only after the step that read the last copy has synchronised (the
        runner's one wait per step)."""
        changed = False
        for r in reqs:
            s, table = r.slot, r.block_table
            blocks = table.blocks
            n = len(blocks)
            if n > self._np.shape[1]:
                raise ValueError(
                    f"request {r.id} owns {n} blocks, over max_blocks_per_req={self._np.shape[1]}; raise max_model_len"
                )
            held = int(self._held[s]) if self._owner[s] is table else -1
            if held == n:
                continue
            start = 0 if held < 0 or held > n else held
            self._np[s, start:n] = blocks[start:]
            self._owner[s], self._held[s] = table, n
            changed = True
        if changed:
            self.tables.copy_(self._host, non_blocking=True)
            self.uploads += 1
