"""The paged KV cache: per-layer K and V block pools, a block allocator and per-request block tables.

Rollback is by length: a rejected token's K/V stays in its slot, every read stops at the reading token's visible
length, and a later step overwrites those slots before anything reads them. The target and the drafter share one
block table per request (drafter row i at the slot of target position i, runtime/step.py), indexing two caches.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from draftgraph.models.families import family_of


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one model's paged cache: per layer two tensors [num_blocks, block_size, *entry], the entries
    K and V [num_kv_heads, head_dim] each, or as `entries` says (MLA: the latent [r] and RoPE key [d_rope])."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    entries: tuple[tuple[int, ...], ...] = ()  # () = ((num_kv_heads, head_dim),) * 2
    # Layers without paged KV (Qwen3.5's Gated DeltaNet): their entry holds runtime/state_cache.py's tensors.
    linear_layers: tuple[int, ...] = ()

    @property
    def entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.entries or ((self.num_kv_heads, self.head_dim),) * 2

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (1, 2, 4, ..., 256)")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 1")

    @classmethod
    def for_model(cls, cfg, num_layers: int, num_blocks: int, block_size: int) -> KVCacheSpec:
        """The cache of a model with ModelConfig `cfg` and `num_layers` layers that hold KV."""
        linear = tuple(i for i in family_of(cfg).state_layers(cfg) if i < num_layers)
        return cls(
            num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, cfg.kv_entry_shapes, linear
        )

    @property
    def bytes_per_block(self) -> int:
        per_token = sum(math.prod(e) for e in self.entry_shapes)
        layers = self.num_layers - len(self.linear_layers)  # linear layers keep no paged KV
        return layers * self.block_size * per_token * torch.finfo(self.dtype).bits // 8


class PagedKVCache:
    """K and V tensors for every layer; layer i reads and writes `layers[i] = (k, v)` in place.

    `reserve_blocks` > 0 (CUDA with virtual memory management, runtime/growable.py): every tensor's address
    range is reserved for that many blocks up front and `resize` to at most that many grows the tensors in place,
    at the addresses CUDA graphs captured them with (`grows_in_place`); otherwise `resize` reallocates.
    `traced` False: no Dynamo trace reads the tensors (an engine that compiles nothing), so their block dimension
    is not marked dynamic, and Dynamo is not imported for it (a second of such a start)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str, reserve_blocks: int = 0, traced: bool = True):
        self.device = device
        self.traced = traced
        self.layers: list[tuple[torch.Tensor, ...]] = []
        self.state = None  # runtime/state_cache.py's StateCache for linear_layers, once attached
        self.reserve_blocks = max(reserve_blocks, spec.num_blocks) if reserve_blocks else 0
        self._buffers: list[list] = []  # per layer, the GrowableBuffer behind each tensor (when reserved)
        if self.reserve_blocks:
            from draftgraph.runtime.growable import GrowableBuffer

            per_block = [spec.block_size * math.prod(e) * spec.dtype.itemsize for e in spec.entry_shapes]
            self._buffers = [
                [] if i in spec.linear_layers else [GrowableBuffer(self.reserve_blocks * b, device) for b in per_block]
                for i in range(spec.num_layers)
            ]
        self._allocate(spec)

    @property
    def grows_in_place(self) -> bool:
        return bool(self.reserve_blocks)

    @property
    def mapped_bytes(self) -> int:
        """Device memory mapped for the tensors of a reserved cache (outside torch's allocator); 0 otherwise."""
        return sum(b.mapped for bufs in self._buffers for b in bufs)

    @property
    def num_tensors(self) -> int:
        return sum(len(self.spec.entry_shapes) for i in range(self.spec.num_layers) if i not in self.spec.linear_layers)

    def _allocate(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        shapes = [(spec.num_blocks, spec.block_size, *e) for e in spec.entry_shapes]

        def grown(buf, shape) -> torch.Tensor:
            buf.grow(math.prod(shape) * spec.dtype.itemsize)  # new bytes are zeroes, as torch.zeros gives
            return buf.tensor(shape, spec.dtype)

        def entry(i: int) -> tuple[torch.Tensor, ...]:
            if i in spec.linear_layers:
                return self.state.layer(i) if self.state is not None else ()
            if self._buffers:
                return tuple(grown(b, s) for b, s in zip(self._buffers[i], shapes))
            return tuple(torch.zeros(s, dtype=spec.dtype, device=self.device) for s in shapes)

        self.layers[:] = [entry(i) for i in range(spec.num_layers)]  # in place: holders of `layers` see them
        if not self.traced:
            return
        # The block count is a runtime size: compiled code must not specialize on it, so an engine whose
        # cache is resized after measuring graph memory (runtime/memory.py) re-uses its traces.
        from torch._dynamo.decorators import maybe_mark_dynamic  # here: torch._dynamo costs ~1 s to import

        for i, kv in enumerate(self.layers):
            for t in kv if i not in spec.linear_layers else ():
                maybe_mark_dynamic(t, 0)

    def resize(self, num_blocks: int) -> None:
        """Every layer at `num_blocks` blocks. Reserved (`grows_in_place`) and within the reservation: the same
        addresses, the blocks kept, new ones zeroed (a smaller count keeps its memory mapped). Otherwise
        reallocated (contents dropped; the old tensors go first)."""
        if self.reserve_blocks and num_blocks > self.reserve_blocks:
            raise ValueError(f"num_blocks={num_blocks} is more than the {self.reserve_blocks} blocks reserved")
        if not self.reserve_blocks:
            self.layers[:] = []
        if self.state is not None:
            self.state.resize_blocks(num_blocks)
        self._allocate(replace(self.spec, num_blocks=num_blocks))


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """The cache blocks of one engine, shared by all requests: reference counts, a free list, and (prefix caching,
    runtime/prefix_cache.py) the blocks registered under a hash with the LRU order of those no request holds.

    A block is held (count > 0), free and cached (count 0, registered: its contents kept for a later request
    whose prefix hashes the same, in `_lru`), or free and empty (`_free`). `allocate` takes empty blocks first,
    then evicts the least recently freed cached ones; `num_free` counts both kinds."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # registered blocks without a draft model's entries (adaptive speculation's K = 0 steps skipped them): a
        # request that finds one catches the draft model up from there (runtime/scheduler.py sets its `draft_lag`)
        self._draft_missing: set[int] = set()
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an `allocate` may hand out: empty ones and cached ones no request holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (held or not)."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks with {self.num_free} of {self.num_blocks} free; "
                "raise num_blocks (or lower max_num_seqs / max_model_len)"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently freed cached block
                b, _ = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self._draft_missing.discard(b)
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks) -> None:
        """Drop one reference to each block. A block no request holds any more stays cached if registered (the
        last blocks of `blocks` become the first to be evicted: they are the least likely to be shared), else
        returns to the free list."""
        for b in reversed(list(blocks)):
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than it was allocated or shared")
            if self._ref[b]:
                continue
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._free.append(b)

    # ---- prefix caching ----------------------------------------------------------------------------

    def lookup(self, hashes) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a chain: block i's hash covers blocks 0..i)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def is_cached(self, h: bytes) -> bool:
        """Whether a block is registered under this chain hash."""
        return h in self._block_of

    def num_unheld(self, blocks) -> int:
        """How many of these cached blocks no request holds (sharing them takes them off `num_free`)."""
        return sum(1 for b in blocks if not self._ref[b])

    def share(self, blocks) -> None:
        """One more reference to each of these cached blocks (a request that found them by `lookup`)."""
        for b in blocks:
            if not self._ref[b]:
                del self._lru[b]
            self._ref[b] += 1

    def register(self, block: int, h: bytes, draft_missing: bool = False) -> bool:
        """Name a held block, whose every cache entry is final, by its chain hash; False when another block
        holds that hash already (two requests computed the same prefix at once: the first one's is kept).
        `draft_missing`: every entry is final but a draft model's, which steps at K = 0 skipped."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        if draft_missing:
            self._draft_missing.add(block)
        return True

    def draft_missing(self, block: int) -> bool:
        return block in self._draft_missing

    def draft_written(self, block: int) -> None:
        """A draft model caught up on this block (its request's `catch_up`): its entries are final too."""
        self._draft_missing.discard(block)


class BlockTable:
    """The blocks one request owns, grown on demand; shrinking is by length only (no copies). The ids are kept
    in a numpy array (`blocks`: a read-only view), so that every step's metadata build copies a request's row in
    one call (runtime/attn_metadata.py) instead of converting a list id by id: at long contexts that conversion
    was most of the build's host time.

    With prefix caching the table may start with shared cached blocks (`adopt`), and remembers its request's
    chain hashes (`hashes`: they depend on tokens only, which never change, so they outlive a release) and how
    many of its blocks were registered (`num_registered`), and of those how many hold a draft model's entries too
    (`num_draft_written`; adaptive speculation's K = 0 steps skip them)."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self._ids = np.empty(0, dtype=np.int64)
        self._n = 0
        self.hashes: list[bytes] = []
        self.num_registered = 0
        self.num_draft_written = 0

    @property
    def blocks(self) -> np.ndarray:
        """The ids of the blocks, in position order (a read-only view: grow with `ensure_capacity`)."""
        view = self._ids[: self._n]
        view.flags.writeable = False
        return view

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks to allocate before the table holds `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - self._n)

    def ensure_capacity(self, num_tokens: int) -> None:
        needed = self.blocks_needed(num_tokens)
        if not needed:
            return
        self._append(self.allocator.allocate(needed))

    def adopt(self, cached: list[int], private_first: bool = False) -> None:
        """Start an empty table with cached blocks found by `BlockAllocator.lookup` (shared here). `private_first`:
        the first is a new block instead, for its owner to fill with the cached one's contents (hybrid models:
        runtime/state_snapshots.py); it stays unregistered (the cached one holds its hash)."""
        if self._n:
            raise RuntimeError(f"adopt() starts an empty table; this one holds {self._n} blocks")
        private = private_first and bool(cached)
        shared = cached[1:] if private else cached
        self.allocator.share(shared)  # before allocating: the new block must not evict one of these
        self._append((self.allocator.allocate(1) if private else []) + list(shared))
        self.num_registered = len(cached)
        missing = [i for i, b in enumerate(cached) if self.allocator.draft_missing(b)]
        self.num_draft_written = missing[0] if missing else len(cached)

    def _append(self, new: list[int]) -> None:
        needed = len(new)
        if self._n + needed > len(self._ids):  # doubling: a request's table is copied O(log n) times
            grown = np.empty(max(16, 2 * len(self._ids), self._n + needed), dtype=np.int64)
            grown[: self._n] = self._ids[: self._n]
            self._ids = grown
        self._ids[self._n : self._n + needed] = new
        self._n += needed

    def release(self) -> None:
        self.allocator.free(self.blocks.tolist())
        self._n = 0
        self.num_registered = 0
        self.num_draft_written = 0
