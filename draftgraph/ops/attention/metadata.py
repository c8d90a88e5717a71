"""AttentionMetadata: what the paged attention op needs to know about a flat batch of T tokens.

Every tensor here is a view of a preallocated device buffer (runtime/attn_metadata.py builds them), so
a captured graph that reads these addresses sees the next batch after the builder refills them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class AttentionMetadata:
    """Per-token and per-request tensors for one forward over the flat token layout.

    Tokens of request r occupy input rows query_start_loc[r] .. query_start_loc[r+1]-1. Padding rows
    (appended by graph padding) have slot_mapping == -1 (nothing written) and token_kv_len == 0 (their
    output is zeros), so they never touch real state.
    """

    slot_mapping: torch.Tensor  # [T] int64: KV-cache slot (block * block_size + offset), -1 = skip
    token_req: torch.Tensor  # [T] int32: row of block_tables each token reads
    token_kv_len: torch.Tensor  # [T] int32: keys visible to the token (its position + 1; causal)
    block_tables: torch.Tensor  # [B, max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [B] int32: cached tokens per request once this step is written
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


# The field names in order: how flat tensor dicts (FULL graph inputs, the fused loop's arguments) spell them.
META_FIELDS = tuple(f.name for f in fields(AttentionMetadata))
