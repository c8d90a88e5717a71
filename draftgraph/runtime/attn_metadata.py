"""Host-side build of AttentionMetadata into preallocated device buffers.

The buffers are allocated once at their maximum size; each build fills a pinned host mirror, copies it
over without a sync, and returns views of the first T / B rows. Those views keep the same addresses
from step to step, which is what captured CUDA graphs read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draftgraph.ops.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class RequestSlice:
    """One request's part of a batch: `query_len` new tokens after `num_cached` already cached."""

    block_table: Sequence[int]
    num_cached: int
    query_len: int


class MetadataBuilder:
    """Preallocated metadata and position buffers for batches of up to max_tokens / max_reqs."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, block_size: int, device):
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.max_blocks_per_req, self.block_size = max_blocks_per_req, block_size
        self.device = torch.device(device)
        pin = self.device.type == "cuda"

        def pair(shape, dtype, fill=0):
            host = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
            return host, torch.full(shape, fill, dtype=dtype, device=self.device)

        self._h_slot, self.slot_mapping = pair((max_tokens,), torch.int64, -1)
        self._h_req, self.token_req = pair((max_tokens,), torch.int32)
        self._h_kvlen, self.token_kv_len = pair((max_tokens,), torch.int32)
        self._h_pos, self.positions = pair((max_tokens,), torch.int64)
        self._h_tables, self.block_tables = pair((max_reqs, max_blocks_per_req), torch.int32)
        self._h_seq, self.seq_lens = pair((max_reqs,), torch.int32)
        self._h_qsl, self.query_start_loc = pair((max_reqs + 1,), torch.int32)
        # numpy views of the pinned mirrors, made once (each build writes through them)
        self._np = {
            "slot": self._h_slot.numpy(),
            "req": self._h_req.numpy(),
            "kvlen": self._h_kvlen.numpy(),
            "pos": self._h_pos.numpy(),
            "seq": self._h_seq.numpy(),
            "qsl": self._h_qsl.numpy(),
            "tables": self._h_tables.numpy(),
        }

    def build(
        self,
        reqs: Sequence[RequestSlice],
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Fill the buffers for `reqs`; returns the metadata views and positions [T_padded]."""
        qlens = np.array([r.query_len for r in reqs], dtype=np.int64)
        cached = np.array([r.num_cached for r in reqs], dtype=np.int64)
        num_tokens = int(qlens.sum())
        t_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
        b_pad = len(reqs) if num_reqs_padded is None else num_reqs_padded
        self._check(reqs, num_tokens, t_pad, b_pad, cached + qlens)

        starts = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(qlens, out=starts[1:])
        req_of_token = np.repeat(np.arange(len(reqs)), qlens)
        positions = cached[req_of_token] + (np.arange(num_tokens) - starts[req_of_token])
        # Rows go straight into the pinned mirror; a BlockTable's ids are a numpy array: one copy per row.
        h = self._np
        tables = h["tables"][:b_pad]
        tables.fill(0)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_table)] = r.block_table
        block_of_token = tables[req_of_token, positions // self.block_size].astype(np.int64)
        slots = block_of_token * self.block_size + positions % self.block_size

        h["slot"][:num_tokens], h["slot"][num_tokens:t_pad] = slots, -1  # padding rows write nothing
        h["req"][:num_tokens], h["req"][num_tokens:t_pad] = req_of_token, 0
        h["kvlen"][:num_tokens], h["kvlen"][num_tokens:t_pad] = positions + 1, 0  # padding sees nothing
        h["pos"][:num_tokens], h["pos"][num_tokens:t_pad] = positions, 0
        h["seq"][: len(reqs)], h["seq"][len(reqs) : b_pad] = cached + qlens, 0
        h["qsl"][: len(reqs) + 1], h["qsl"][len(reqs) + 1 : b_pad + 1] = starts, num_tokens

        for host, dev, n in (
            (self._h_slot, self.slot_mapping, t_pad),
            (self._h_req, self.token_req, t_pad),
            (self._h_kvlen, self.token_kv_len, t_pad),
            (self._h_pos, self.positions, t_pad),
            (self._h_tables, self.block_tables, b_pad),
            (self._h_seq, self.seq_lens, b_pad),
            (self._h_qsl, self.query_start_loc, b_pad + 1),
        ):
            dev[:n].copy_(host[:n], non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t_pad],
            token_req=self.token_req[:t_pad],
            token_kv_len=self.token_kv_len[:t_pad],
            block_tables=self.block_tables[:b_pad],
            seq_lens=self.seq_lens[:b_pad],
            query_start_loc=self.query_start_loc[: b_pad + 1],
        )
        return meta, self.positions[:t_pad]

    def _check(self, reqs, num_tokens, t_pad, b_pad, seq_lens) -> None:
        if t_pad < num_tokens or t_pad > self.max_tokens:
            raise ValueError(f"padded token count {t_pad} must lie in [{num_tokens}, {self.max_tokens}]")
        if b_pad < len(reqs) or b_pad > self.max_reqs:
            raise ValueError(f"padded request count {b_pad} must lie in [{len(reqs)}, {self.max_reqs}]")
        for r, total in zip(reqs, seq_lens):
            if len(r.block_table) * self.block_size < total:
                raise ValueError(
                    f"a request needs {int(total)} cached tokens but owns {len(r.block_table)} blocks of "
                    f"{self.block_size}; call BlockTable.ensure_capacity before building metadata"
                )
            if len(r.block_table) > self.max_blocks_per_req:
                raise ValueError(
                    f"a request owns {len(r.block_table)} blocks, over max_blocks_per_req="
                    f"{self.max_blocks_per_req}; raise max_model_len"
                )
