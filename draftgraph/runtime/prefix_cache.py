"""Automatic prefix caching: full KV blocks named by a hash chain over token ids, found again by later requests.

A block's hash is blake2b(parent block's hash, the block's token ids [, the token after it]); the chain starts
from a seed of what fixes a cache's bytes for given tokens (`cache_seed`). The allocator (runtime/kv_cache.py)
keeps registered blocks after their requests end, reference-counted while shared and evicted least recently
used when it needs a block; the scheduler (runtime/scheduler.py) looks a new request's prompt up and registers
blocks as they become final.

When a block is final. Target and drafter share one block table (runtime/step.py), so a block holds every
cache's entries for its positions, and may be registered only once all of them are final:
* the target's entry at p, and a draft model's, depend on tokens 0..p;
* a head drafter's (EAGLE, EAGLE-3, MTP) entry at p pairs the target's hidden state at p with the token at
  p+1, so it depends on tokens 0..p+1: such chains hash the token after each block too (`lookahead` = 1),
  and a block is known only once that token is;
* speculative writes (a verify's rejected drafts, the draft loop's later steps, a draft model's extra row)
  lie at positions >= the request's `num_computed`, and each step rewrites them before anything reads them.
* with adaptive speculation a draft model skipped by K = 0 steps has no entries from the request's `draft_lag` on
  until it catches up (runtime/step.py `catch_up`): blocks past there are registered as missing them
  (`BlockAllocator.draft_missing`: every other entry is final), and marked once it caught up. A request whose
  cached prefix holds such a block starts with its `draft_lag` there, and the draft model catches up on it
  (writing the shared block's entries: the same values for the same tokens) before its next step at K > 0; so at
  K = 0 prompts still find their prefixes cached, as in plain decoding.
The rule: block i (positions i*B .. (i+1)*B-1) is registered once (i+1)*B <= num_computed, and its hash's
tokens (up to (i+1)*B - 1 + lookahead) are in the request's tokens. Every position < num_computed holds an
accepted token in every cache (a head drafter's entry at num_computed - 1 reads tokens[num_computed], the
request's last token, known), so the last position of such a block and the next one are accepted tokens;
a rejected position is never registered. A lookup never covers a whole prompt: at least its last token is
computed, so the step has logits to sample the first token from (as vLLM).

Hybrid models (Gated DeltaNet, runtime/state_cache.py) keep their recurrent state per request, not per block: a
cached prefix also needs the state at its end. runtime/state_snapshots.py keeps snapshots of it at block
boundaries (named by the same chain hashes), and a hit is cut to the longest prefix that has both its blocks and a
snapshot at its end; a draft model with linear layers of its own turns prefix caching off (`prefix_key` logs why).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("draftgraph")


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block whose chain so far hashes to `parent`: stable across processes (not Python's hash)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def cache_seed(*parts: str) -> bytes:
    """The chain's start: a hash of what changes a cache's contents for the same tokens."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixKey:
    """How one engine names its blocks: the seed, the block size, and the tokens past a block its entries
    depend on (1 with a head drafter, else 0)."""

    seed: bytes
    block_size: int
    lookahead: int = 0

    def extend(self, hashes: list[bytes], tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """`hashes` (the chain of tokens' first blocks) extended in place to `num_blocks` blocks, as far as
        `tokens` reach (a block's hash reads `lookahead` tokens past it)."""
        bs = self.block_size
        while len(hashes) < num_blocks and (len(hashes) + 1) * bs + self.lookahead <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.seed
            hashes.append(chain_hash(parent, tokens[i * bs : (i + 1) * bs + self.lookahead]))
        return hashes

    def max_hit_blocks(self, prefill_len: int) -> int:
        """The most blocks a lookup may cover before a prefill of `prefill_len` tokens: all but its last token."""
        return max(prefill_len - 1, 0) // self.block_size


@dataclass
class PrefixCacheStats:
    """Lookups since the last reset: prompt tokens (and full blocks) looked up, and those found cached; and the
    prompt tokens the models then computed (`prefill_tokens`: every scheduled chunk, cache on or off)."""

    enabled: bool
    query_tokens: int = 0
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    prefill_tokens: int = 0

    def record(self, prefill_len: int, block_size: int, hits: int) -> None:
        self.query_tokens += prefill_len
        self.query_blocks += prefill_len // block_size
        self.hit_tokens += hits * block_size
        self.hit_blocks += hits

    def as_dict(self, cached_blocks: int, evictions: int) -> dict:
        return {
            "enabled": self.enabled,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "query_blocks": self.query_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "prefill_tokens": self.prefill_tokens,  # prompt tokens computed (in chunks), not found cached
            "cached_blocks": cached_blocks,  # registered now (held or not)
            "evictions": evictions,  # since the engine was built
        }


def prefix_key(target, drafter, rc, k: int, off: str = "") -> PrefixKey | None:
    """The engine's PrefixKey, or None when prefix caching is off (asked, or `off` says why: logged)."""
    if not rc.prefix_caching:
        return None
    if off:
        log.info("prefix caching off: %s", off)
        return None
    # One engine's cache holds one pair's weights, so what else changes its bytes for the same tokens: the models'
    # configurations and dtypes, the drafter's kind and inputs, the kernels that write the KV layout, the block size.
    parts = [repr(target.cfg), str(target.cfg.dtype), rc.attention, repr(rc.ops), str(rc.block_size)]
    head = False
    if drafter is not None and k:
        head = drafter.target_hidden != "none"
        parts += [type(drafter).__name__, drafter.target_hidden, repr(drafter.cfg), str(drafter.cfg.dtype),
                  str(getattr(drafter, "aux_layers", ()))]  # fmt: skip
    return PrefixKey(cache_seed(*parts), rc.block_size, int(head))
