"""One speculative decoding step on the device: verify, accept, propose; one copy to the host at the end.

Flat batch layout: decode requests first (each [last token, d1..dK] at positions n..n+K), then prefill
chunks. The target runs once over all rows. Acceptance happens on the device, and so does everything
that depends on it:

* Drafter step 1 runs over a fixed set of rows chosen without knowing the accepted count `a`.
  Hidden-state drafters (EAGLE, EAGLE-3, MTP) take every verify and prefill row: row i pairs the
  target hidden state at i with the token at i+1, which the device picks (accepted draft, or the new
  token y at row a, filler past it). An independent draft model takes K+2 rows per decode request:
  its own tokens n..n+K+1, with y at n+a+1. The first draft is read at row n+a (n+a+1 for the draft
  model). Rows past it hold stale keys that later steps overwrite before they are read (reads stop at
  each token's position, so KV is rolled back by length, never copied).
* Steps 2..K take one row per request. Positions, slots and visible lengths advance on the device
  from the block table, so no host work sits between draft steps.

Both caches use the same block tables: drafter row i lives at the same slot as target position i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.models.attention.metadata import AttentionMetadata
from draftgraph.models.drafters.base import Drafter
from draftgraph.models.llama import CausalLM
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatch, Dispatcher
from draftgraph.runtime.forwards import Forwards
from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache
from draftgraph.runtime.rejection import rejection_sample
from draftgraph.runtime.request import Request
from draftgraph.runtime.sampler import SALT_DRAFT, SamplingTensors, probabilities, sample, sample_from_probs
from draftgraph.runtime.scheduler import ScheduledBatch


@dataclass(frozen=True)
class RunnerShape:
    """Sizes the runner preallocates for (resolved from CompileConfig)."""

    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_req: int
    num_kv_blocks: int
    block_size: int
    capture_sizes: tuple[int, ...] = ()  # compiled token counts: the metadata buffers must hold the largest


@dataclass
class StepResult:
    """Host copies of one step's outcome (index i follows `sampled` order: decodes, then last chunks)."""

    sampled: list[Request]
    emitted: list[list[int]]  # tokens each sampled request emits this step
    accepted: list[int]  # accepted drafts per decode request (len = number of decodes)
    drafts: list[list[int]]  # the next K proposals per sampled request


def sampling_tensors(reqs: list[Request], device) -> SamplingTensors:
    p = [r.params for r in reqs]
    return SamplingTensors(
        temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32).to(device, non_blocking=True),
        top_k=torch.tensor([x.top_k for x in p], dtype=torch.long).to(device, non_blocking=True),
        top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32).to(device, non_blocking=True),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.long).to(device, non_blocking=True),
        greedy_rows=tuple(x.temperature <= 0 for x in p),
    )


class StepRunner:
    """Owns the KV caches and metadata buffers of a target and its drafter; runs one step at a time."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None,
        shape: RunnerShape,
        device,
        dispatcher: Dispatcher,
        target_fn=None,
        drafter_fn=None,
        full_target=None,
        full_drafter=None,
    ):
        self.target, self.drafter, self.shape = target, drafter, shape
        self.device = torch.device(device)
        self.dispatcher = dispatcher
        # The callables that run the forwards: the modules themselves (mode NONE) or their compiled forms.
        self.target_fn = target_fn or target
        self.drafter_fn = drafter_fn or drafter
        max_tokens = max(shape.max_num_batched_tokens, *shape.capture_sizes, 1)
        self.k = shape.num_speculative_tokens if drafter is not None else 0
        bs, nb = shape.block_size, shape.num_kv_blocks
        tc = target.cfg
        self.target_cache = PagedKVCache(
            KVCacheSpec(tc.num_layers, nb, bs, tc.num_kv_heads, tc.head_dim, tc.dtype), self.device
        )
        self.target_meta = MetadataBuilder(max_tokens, shape.max_num_seqs, shape.max_blocks_per_req, bs, self.device)
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, K, V]: q of pending drafts, by slot
        if drafter is not None:
            dc = drafter.cfg
            self.draft_cache = PagedKVCache(
                KVCacheSpec(drafter.num_kv_layers, nb, bs, dc.num_kv_heads, dc.head_dim, dc.dtype), self.device
            )
            self.hidden_kind = drafter.target_hidden != "none"
            self.aux_layers = drafter.aux_layers if drafter.target_hidden == "aux" else ()
        self.forwards = Forwards(
            self.target_fn,
            self.drafter_fn,
            self.target_cache.layers,
            self.draft_cache.layers if drafter is not None else None,
            getattr(self, "aux_layers", ()),
            full_target,
            full_drafter,
        )
        if drafter is not None and not self.hidden_kind:  # a draft model's step 1 has a row more per request
            self.draft_meta = MetadataBuilder(
                max_tokens + shape.max_num_seqs,
                shape.max_num_seqs,
                shape.max_blocks_per_req,
                bs,
                self.device,
            )

    # ---- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> StepResult:
        k, dev = self.k, self.device
        decodes, chunks = batch.decodes, batch.prefills
        last_chunks = [c for c in chunks if c.last]
        sampled = decodes + [c.req for c in last_chunks]
        nd = len(decodes)

        slices, ids = [], []
        for r in decodes:
            slices.append(RequestSlice(r.block_table.blocks, r.num_computed, k + 1))
            ids += [r.tokens[-1], *r.drafts]
        chunk_rows = []  # (first row, num rows) per chunk
        for c in chunks:
            s = c.req.num_computed
            chunk_rows.append((len(ids), c.num_tokens))
            slices.append(RequestSlice(c.req.block_table.blocks, s, c.num_tokens))
            ids += c.req.tokens[s : s + c.num_tokens]
        uniform = k + 1 if nd and not chunks else None  # every request verifies 1 + K tokens
        d = self.dispatcher.dispatch(BatchDescriptor(len(ids), len(slices), uniform))
        meta, positions = self.target_meta.build(slices, num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
        input_ids = torch.tensor(ids + [0] * (d.num_tokens - len(ids)), dtype=torch.long).to(dev, non_blocking=True)
        hidden, aux = self.forwards.target(d, input_ids, positions, meta)

        last_rows = [chunk_rows[i][0] + chunk_rows[i][1] - 1 for i, c in enumerate(chunks) if c.last]
        rows = torch.tensor(list(range(nd * (k + 1))) + last_rows, dtype=torch.long).to(dev, non_blocking=True)
        logits = self.target.compute_logits(hidden, rows)  # [nd*(K+1) + last chunks, V]
        st = sampling_tensors(sampled, dev)
        st_dec, st_pre = st.rows(slice(0, nd)), st.rows(slice(nd, None))

        vocab = logits.shape[-1]
        dec_logits = logits[: nd * (k + 1)].view(nd, k + 1, vocab)
        dec_pos = positions[: nd * (k + 1)].view(nd, k + 1) + 1  # positions the verify rows predict
        if k:
            draft_ids = input_ids[: nd * (k + 1)].view(nd, k + 1)[:, 1:]
            q = None
            if not st_dec.all_greedy:
                q = self.draft_probs[torch.tensor([r.slot for r in decodes], device=dev)]
            dec_tokens, accepted = rejection_sample(dec_logits, draft_ids, q, st_dec, dec_pos)
        else:
            dec_tokens = sample(dec_logits[:, 0], st_dec, dec_pos[:, 0])[:, None]
            accepted = torch.zeros(nd, dtype=torch.long, device=dev)
        pre_pos = positions[torch.tensor(last_rows, dtype=torch.long, device=dev)] + 1
        pre_tokens = sample(logits[nd * (k + 1) :], st_pre, pre_pos)
        y = torch.cat([dec_tokens.gather(1, accepted[:, None])[:, 0], pre_tokens])  # [Bs] each request's new token

        parts = [dec_tokens.flatten(), accepted, pre_tokens]
        if k and (sampled or chunks):  # drafter KV for prompt chunks is written even when nothing samples
            parts.append(
                self._propose(
                    sampled,
                    decodes,
                    chunks,
                    chunk_rows,
                    ids,
                    input_ids,
                    positions,
                    meta,
                    hidden,
                    aux,
                    accepted,
                    y,
                    st,
                    d,
                ).flatten()
            )
        host = torch.cat(parts).tolist()  # the step's one device -> host copy

        dec_flat, host = host[: nd * (k + 1)], host[nd * (k + 1) :]
        acc, host = host[:nd], host[nd:]
        pre, host = host[: len(last_chunks)], host[len(last_chunks) :]
        emitted = [dec_flat[i * (k + 1) : i * (k + 1) + acc[i] + 1] for i in range(nd)] + [[t] for t in pre]
        drafts = [host[i * k : (i + 1) * k] for i in range(len(sampled))] if k else [[] for _ in sampled]
        return StepResult(sampled, emitted, acc, drafts)

    # ---- drafting ---------------------------------------------------------------------------------

    def _propose(
        self,
        sampled,
        decodes,
        chunks,
        chunk_rows,
        ids,
        input_ids,
        positions,
        meta,
        hidden,
        aux,
        accepted,
        y,
        st,
        d: Dispatch,
    ) -> torch.Tensor:
        """K draft tokens [Bs, K] (target ids) for every request that emitted a token this step. `d` is the
        target's dispatch: a hidden-state drafter's first step runs on the same rows, so the same shape."""
        k, dev, nd = self.k, self.device, len(decodes)
        y_dec, y_pre = y[:nd], y[nd:]
        j = torch.arange(k + 2, device=dev)[None, :]
        if self.hidden_kind:
            # Row i takes the token at i+1: prompt tokens for chunks (y after a prompt's end), and for
            # decodes the accepted drafts then y (entries past row a are filler).
            shifted = list(ids) + [0] * (input_ids.shape[0] - len(ids))  # padding rows too
            for (first, n), c in zip(chunk_rows, chunks):
                s = c.req.num_computed
                shifted[first : first + n] = (c.req.tokens[s + 1 : s + n + 1] + [0])[:n]
            tok = torch.tensor(shifted, dtype=torch.long).to(dev, non_blocking=True)
            drafts_pad = torch.cat([input_ids[: nd * (k + 1)].view(nd, k + 1)[:, 1:], y_dec[:, None]], dim=1)
            tok[: nd * (k + 1)] = torch.where(j[:, : k + 1] < accepted[:, None], drafts_pad, y_dec[:, None]).flatten()
            shift, d_meta, d_pos, rows_per_dec, d1 = 2, meta, positions, k + 1, d
            h_in = torch.cat(aux, dim=-1) if self.aux_layers else hidden
        else:
            slices, host_tok = [], []
            for r in decodes:
                slices.append(RequestSlice(r.block_table.blocks, r.num_computed, k + 2))
                host_tok += [r.tokens[-1], *r.drafts, 0]
            for c in chunks:
                s = c.req.num_computed
                slices.append(RequestSlice(c.req.block_table.blocks, s, c.num_tokens + int(c.last)))
                host_tok += c.req.tokens[s : s + c.num_tokens] + ([0] if c.last else [])
            uniform = k + 2 if nd and not chunks else None
            d1 = self.dispatcher.dispatch(BatchDescriptor(len(host_tok), len(slices), uniform))
            d_meta, d_pos = self.draft_meta.build(slices, num_tokens_padded=d1.num_tokens, num_reqs_padded=d1.num_reqs)
            host_tok += [0] * (d1.num_tokens - len(host_tok))
            tok = torch.tensor(host_tok, dtype=torch.long).to(dev, non_blocking=True)
            dec = tok[: nd * (k + 2)].view(nd, k + 2)
            tok[: nd * (k + 2)] = torch.where(j == accepted[:, None] + 1, y_dec[:, None], dec).flatten()
            shift, rows_per_dec, h_in = 1, k + 2, None
        # Each request's sampling row: decodes at their accepted count, chunks at their last row.
        offset = 0 if self.hidden_kind else 1
        starts = torch.arange(nd, device=dev) * rows_per_dec
        chunk_last, row = [], nd * rows_per_dec
        for c in chunks:
            n = c.num_tokens + (0 if self.hidden_kind else int(c.last))
            if c.last:
                chunk_last.append(row + n - 1)
            row += n
        last_t = torch.tensor(chunk_last, dtype=torch.long).to(dev, non_blocking=True)
        if len(chunk_last):
            tok[last_t] = y_pre
        sample_rows = torch.cat([starts + accepted + offset, last_t])

        next_h, logit_h = self.forwards.drafter(d1, tok, d_pos, h_in, d_meta)
        if not sampled:
            return torch.empty(0, k, dtype=torch.long, device=dev)
        row_pos = d_pos[sample_rows]  # [Bs]
        table_rows = torch.tensor(
            [i for i in range(nd)] + [nd + i for i, c in enumerate(chunks) if c.last], dtype=torch.long
        ).to(dev, non_blocking=True)
        tables = d_meta.block_tables[table_rows]  # [Bs, max_blocks]
        slots = torch.tensor([r.slot for r in sampled], dtype=torch.long).to(dev, non_blocking=True)
        h, out = next_h[sample_rows], []
        n = len(sampled)
        d_step = self.dispatcher.dispatch(BatchDescriptor(n, n, 1))  # later steps: one row per request
        n_pad = d_step.num_tokens
        for step in range(k):
            if step:
                pos, step_meta = self._advance(tables, row_pos + step, n_pad, d_step.num_reqs)
                h_pad = _pad_rows(h, n_pad) if self.hidden_kind else None
                h, logit_h = self.forwards.drafter(d_step, _pad_rows(out[-1], n_pad), pos, h_pad, step_meta)
                h, logit_h = h[:n], logit_h[:n]
            rows = sample_rows if step == 0 else None
            out.append(
                self._choose(self.drafter.compute_logits(logit_h, rows), st, row_pos + step + shift, slots, step)
            )
        return torch.stack(out, dim=1)

    def _advance(self, tables: torch.Tensor, pos: torch.Tensor, n_pad: int, reqs_pad: int):
        """Positions [n_pad] and metadata for one row per request at `pos`, built on the device from the
        block tables; rows past the real n are padding (slot -1, nothing visible), and request rows past n
        (FULL graphs pad requests too) own nothing."""
        bs = self.shape.block_size
        n = pos.shape[0]
        if reqs_pad > n:
            tables = torch.cat([tables, tables.new_zeros(reqs_pad - n, tables.shape[1])])
        block = tables.gather(1, (pos // bs)[:, None])[:, 0].long()
        pad = n_pad - n
        zeros = torch.zeros(pad, dtype=torch.long, device=pos.device)
        meta = AttentionMetadata(
            slot_mapping=torch.cat([block * bs + pos % bs, zeros - 1]),
            token_req=torch.cat([torch.arange(n, device=pos.device), zeros]).int(),
            token_kv_len=torch.cat([pos + 1, zeros]).int(),
            block_tables=tables,
            seq_lens=torch.cat([pos + 1, pos.new_zeros(reqs_pad - n)]).int(),
            query_start_loc=torch.cat([torch.arange(n + 1, device=pos.device), pos.new_full((reqs_pad - n,), n)]).int(),
        )
        return torch.cat([pos, zeros]), meta

    # ---- capture --------------------------------------------------------------------------------

    @torch.no_grad()
    def dummy_run(self, num_tokens: int) -> None:
        """Run every compiled forward once at `num_tokens` with padding rows only (nothing is written,
        nothing is visible): compiles on the first call, captures graphs while capture is allowed."""
        dev = self.device
        meta, positions = self.target_meta.build([], num_tokens_padded=num_tokens, num_reqs_padded=1)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self.target_fn(ids, positions, meta, self.target_cache.layers, getattr(self, "aux_layers", ()))
        if self.drafter is None:
            return
        widths = [None]
        if self.hidden_kind:
            h = self.drafter.cfg.hidden_size
            widths = [3 * self.target.cfg.hidden_size, h] if self.aux_layers else [h]
        for width in widths:
            hidden = None if width is None else torch.zeros(num_tokens, width, dtype=self.target.cfg.dtype, device=dev)
            self.drafter_fn(ids, positions, hidden, meta, self.draft_cache.layers)

    @torch.no_grad()
    def dummy_run_full(self, num_reqs: int) -> None:
        """Capture (while allowed) the FULL graphs of `num_reqs` padded requests: the target's verify (or
        decode) shape, the drafter's first-step shape and its one-row-per-request shape."""
        dev, k = self.device, self.k
        shapes = [("target", k + 1 if self.drafter is not None else 1, None)]
        if self.drafter is not None:
            h = self.drafter.cfg.hidden_size
            first_width = (3 * self.target.cfg.hidden_size if self.aux_layers else h) if self.hidden_kind else None
            shapes += [
                ("drafter", k + 1 if self.hidden_kind else k + 2, first_width),
                ("drafter", 1, h if self.hidden_kind else None),
            ]
        for fn, q, width in shapes:
            d = self.dispatcher.dispatch(BatchDescriptor(num_reqs * q, num_reqs, q))
            if d.runtime != "FULL":
                continue
            # The same kind of tensors the step passes: builder views, or on-device metadata (later steps).
            if q == 1 and fn == "drafter":
                no_rows = torch.zeros(0, dtype=torch.long, device=dev)
                tables = self.target_meta.block_tables[:0]
                positions, meta = self._advance(tables, no_rows, d.num_tokens, d.num_reqs)
            else:
                builder = self.draft_meta if fn == "drafter" and not self.hidden_kind else self.target_meta
                meta, positions = builder.build([], num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
            ids = torch.zeros(d.num_tokens, dtype=torch.long, device=dev)
            if fn == "target":
                self.forwards.target(d, ids, positions, meta)
            else:
                hidden = (
                    None if width is None else torch.zeros(d.num_tokens, width, dtype=self.target.cfg.dtype, device=dev)
                )
                self.forwards.drafter(d, ids, positions, hidden, meta)

    def _choose(self, logits, st: SamplingTensors, pred_pos, slots, step) -> torch.Tensor:
        """A draft token per request (target ids); for sampling requests record q for the next verify."""
        drafter = self.drafter
        if st.all_greedy:
            return drafter.to_target_ids(logits.argmax(-1))
        q = probabilities(logits, st)  # [Bs, draft_vocab]
        draft = sample_from_probs(q, st.seeds, pred_pos, SALT_DRAFT)
        draft = torch.where(st.temperature <= 0, logits.argmax(-1), draft)
        vocab = self.target.cfg.vocab_size
        if self.draft_probs is None:
            self.draft_probs = torch.zeros(self.shape.max_num_seqs, self.k, vocab, device=self.device)
        self.draft_probs[slots, step] = drafter.draft_probs_to_target(q, vocab)
        return drafter.to_target_ids(draft)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with zero rows appended up to n rows."""
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])
