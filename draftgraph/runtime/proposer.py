"""Proposing the next K drafts, after the target verified: the drafter's first-step inputs, then the
draft loop (runtime/drafting.py), fused into one graph or run step by step.

The first step runs over a fixed set of rows chosen without knowing the accepted count `a`:

* Hidden-state drafters (EAGLE, EAGLE-3, MTP) take every verify and prefill row: row i pairs the
  target hidden state at i with the token at i+1, which the device picks (accepted draft, or the new
  token y at row a, filler past it). The first draft is read at row n+a.
* An independent draft model takes K+2 rows per decode request: its own tokens n..n+K+1, with y at
  n+a+1, and the first draft is read there. Rows past it hold stale keys that later steps overwrite
  before they are read (reads stop at each token's position, so KV is rolled back by length).

A uniform decode batch whose first step dispatches FULL runs the fused loop: one graph replay per
proposal. Anything else runs the same loop around the per-step forwards (piece graphs, per-step FULL
graphs for the later single-token steps, or compiled code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.compiler.build import LOOP_VARIANTS
from draftgraph.compiler.cuda_graphs import GraphKey, StepShapes
from draftgraph.models.drafters.base import Drafter
from draftgraph.ops.attention.metadata import META_FIELDS
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatch, Dispatcher
from draftgraph.runtime.drafting import SAMPLING_FIELDS, Chooser, draft_loop
from draftgraph.runtime.forwards import Forwards
from draftgraph.runtime.sampler import SamplingTensors


@dataclass(frozen=True)
class Verified:
    """What the target's verify (a mixed batch's step, runtime/step.py) hands the proposer: the batch's parts and
    the step's device tensors, by name."""

    sampled: list  # requests that emitted a token: decodes, then prompts whose last chunk ran
    decodes: list
    chunks: list  # prompt chunks (ScheduledChunk), last or not
    chunk_rows: list[tuple[int, int]]  # (first row, rows) of each chunk in the flat batch
    ids: list[int]  # the flat batch's input ids on the host (padding excluded)
    input_ids: torch.Tensor  # [T padded]
    positions: torch.Tensor  # [T padded]
    meta: object  # the target's AttentionMetadata
    hidden: torch.Tensor  # the target's last hidden states [T padded, H]
    aux: tuple | None  # EAGLE-3's auxiliary layer outputs
    accepted: torch.Tensor  # [decodes] accepted drafts
    y: torch.Tensor  # [sampled] each request's new token
    st: SamplingTensors  # sampled requests' parameters
    d: Dispatch  # the target's dispatch


class Proposer:
    def __init__(
        self,
        drafter: Drafter,
        target_cfg,
        k: int,
        block_size: int,
        max_num_seqs: int,
        target_meta: MetadataBuilder,
        draft_meta: MetadataBuilder | None,
        forwards: Forwards,
        dispatcher: Dispatcher,
        device,
        shapes: StepShapes,
        loops=None,
        race_kernel: bool = True,  # OpChoices.race_sampler
    ):
        self.drafter, self.target_cfg, self.k, self.block_size = drafter, target_cfg, k, block_size
        self.target_meta, self.draft_meta, self.forwards, self.dispatcher = (
            target_meta,
            draft_meta,
            forwards,
            dispatcher,
        )
        self.device = torch.device(device)
        self.hidden_kind = drafter.target_hidden != "none"
        self.aux = drafter.target_hidden == "aux"
        self.shift = 2 if self.hidden_kind else 1
        self.shapes = shapes
        self.first_q = shapes.first_draft  # first-step rows per decode request
        # Width of the hidden input at the first step (the target's fused aux layers for EAGLE-3) and at
        # later steps (the drafter's own); None for a draft model, which reads no hidden state.
        h = drafter.cfg.hidden_size
        self.step_width = h if self.hidden_kind else None
        self.first_width = 3 * target_cfg.hidden_size if self.aux else self.step_width
        self.hidden_widths = tuple(dict.fromkeys((self.first_width, self.step_width)))  # one trace each
        self.max_num_seqs = max_num_seqs
        # q of the pending drafts per request slot; the last row is the padding rows' scratch.
        self.draft_probs = torch.zeros(max_num_seqs + 1, k, target_cfg.vocab_size, device=self.device)
        self.choose = Chooser(drafter, target_cfg.vocab_size, race_kernel)
        # Penalties reach the drafter's logits (runtime/penalties.py; a reduced draft vocabulary through its
        # target ids: Chooser.processed); a flag so that a test can compare with raw drafts
        self.processes_drafts = True
        self.loops = loops  # (greedy, sampled) compiled fused loops (FULL modes), else None

    # ---- one proposal ------------------------------------------------------------------------------

    def propose(self, v: Verified, process=None) -> torch.Tensor:
        """K draft tokens [Bs, K] (target ids) for every request that emitted a token this step. `v.d` is the
        target's dispatch: a hidden-state drafter's first step runs on the same rows, so the same shape.
        `process`: the penalties' processing of each draft step (draft_loop), or None."""
        sampled, decodes, chunks, chunk_rows, ids = v.sampled, v.decodes, v.chunks, v.chunk_rows, v.ids
        input_ids, positions, accepted, y, st, d = v.input_ids, v.positions, v.accepted, v.y, v.st, v.d
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
            d_meta, d_pos, d1 = v.meta, positions, d
            h_in = torch.cat(v.aux, dim=-1) if self.aux else v.hidden
        else:
            slices, host_tok = [], []
            for r in decodes:
                slices.append(RequestSlice(r.block_table.blocks, r.num_computed, k + 2))
                host_tok += [r.tokens[-1], *r.drafts, 0]
            for c in chunks:
                s = c.req.num_computed
                slices.append(RequestSlice(c.req.block_table.blocks, s, c.num_tokens + int(c.last)))
                host_tok += c.req.tokens[s : s + c.num_tokens] + ([0] if c.last else [])
            uniform = self.first_q if nd and not chunks else None
            d1 = self.dispatcher.dispatch(BatchDescriptor(len(host_tok), len(slices), uniform))
            d_meta, d_pos = self.draft_meta.build(slices, num_tokens_padded=d1.num_tokens, num_reqs_padded=d1.num_reqs)
            host_tok += [0] * (d1.num_tokens - len(host_tok))
            tok = torch.tensor(host_tok, dtype=torch.long).to(dev, non_blocking=True)
            dec = tok[: nd * (k + 2)].view(nd, k + 2)
            tok[: nd * (k + 2)] = torch.where(j == accepted[:, None] + 1, y_dec[:, None], dec).flatten()
            h_in = None
        # Each request's sampling row: decodes at their accepted count, chunks at their last row.
        offset = 0 if self.hidden_kind else 1
        starts = torch.arange(nd, device=dev) * self.first_q
        chunk_last, row = [], nd * self.first_q
        for c in chunks:
            n = c.num_tokens + (0 if self.hidden_kind else int(c.last))
            if c.last:
                chunk_last.append(row + n - 1)
            row += n
        last_t = torch.tensor(chunk_last, dtype=torch.long).to(dev, non_blocking=True)
        if chunk_last:
            tok[last_t] = y_pre
        sample_rows = torch.cat([starts + accepted + offset, last_t])
        n = len(sampled)
        if not n:  # prompt chunks only: their drafter KV is written, nothing is proposed
            self.forwards.drafter(d1, tok, d_pos, h_in, d_meta)
            return torch.empty(0, k, dtype=torch.long, device=dev)

        table_rows = list(range(nd)) + [nd + i for i, c in enumerate(chunks) if c.last]
        slots = [r.slot for r in sampled]
        return self.run_loop(d1, tok, d_pos, h_in, d_meta, sample_rows, table_rows, slots, st, process)

    def run_loop(self, d1: Dispatch, tok, d_pos, h_in, d_meta, sample_rows, table_rows: list[int], slots: list[int],
                 st: SamplingTensors, process=None) -> torch.Tensor:  # fmt: skip
        """Drafts [n, K] for the n requests whose first drafts come from rows `sample_rows` of the first step
        (dispatched as `d1`); request i reads row table_rows[i] of the block tables and owns slot slots[i]."""
        k, dev, n = self.k, self.device, len(slots)
        uniform = table_rows == list(range(n)) and d1.num_reqs >= n  # decodes only: requests in table order
        fused = self.loops is not None and d1.runtime == "FULL" and uniform
        if fused:
            rows, tables = d1.num_reqs, d_meta.block_tables  # padded by the builder
        else:
            d_step = self.dispatcher.dispatch(BatchDescriptor(n, n, self.shapes.later_draft))
            rows = d_step.num_tokens
            tables = _pad_rows(d_meta.block_tables[torch.tensor(table_rows).to(dev, non_blocking=True)], rows)
        greedy = st.all_greedy
        args = dict(
            sample_rows=_pad_rows(sample_rows, rows),
            valid=torch.arange(rows, device=dev) < n,
            slots=torch.tensor(slots + [self.max_num_seqs] * (rows - n)).to(dev, non_blocking=True),
            draft_probs=self.draft_probs,
        )
        if not greedy:
            args.update({f: _pad_rows(getattr(st, f), rows) for f in SAMPLING_FIELDS})
        if fused:
            key = GraphKey.loop(self.first_q, rows, LOOP_VARIANTS[0 if greedy else 1])
            flat = dict(input_ids=tok, positions=d_pos, hidden=h_in, **{f: getattr(d_meta, f) for f in META_FIELDS})
            drafts = self.forwards.loop(key, {**flat, **args}, self.loops[0 if greedy else 1])
        else:
            sampling = None if greedy else {f: args[f] for f in SAMPLING_FIELDS}

            def first(ids_, pos_, h_, m_):
                return self.forwards.drafter(d1, ids_, pos_, h_, m_)

            def step(ids_, pos_, h_, m_):
                return self.forwards.drafter(d_step, ids_, pos_, h_, m_)

            drafts = draft_loop(first, step, self.choose, k, self.shift, self.block_size, self.hidden_kind, tok,
                                d_pos, h_in, d_meta, args["sample_rows"], args["valid"], tables, sampling,
                                args["slots"], self.draft_probs, process)  # fmt: skip
        return drafts[:n]

    def probs_for(self, slots: list[int]) -> torch.Tensor:
        """q [len(slots), K, V] of the pending drafts of these request slots."""
        return self.draft_probs[torch.tensor(slots).to(self.device, non_blocking=True)]

    # ---- capture --------------------------------------------------------------------------------

    @torch.no_grad()
    def dummy_loops(self, num_reqs: int) -> None:
        """Run (capturing while allowed) both fused loops at `num_reqs` padded requests, on padding only."""
        d = self.dispatcher.dispatch(BatchDescriptor(num_reqs * self.first_q, num_reqs, self.first_q))
        if self.loops is None or d.runtime != "FULL":
            return
        for variant, loop in zip(LOOP_VARIANTS, self.loops):
            x = self.dummy_loop_inputs(d.num_reqs, sampled=variant == "sample")
            self.forwards.loop(GraphKey.loop(self.first_q, d.num_reqs, variant), x, loop)

    def dummy_loop_inputs(self, b: int, sampled: bool) -> dict:
        """The fused loop's inputs for `b` padded requests with padding rows only (nothing written)."""
        dev = self.device
        builder = self.target_meta if self.hidden_kind else self.draft_meta
        meta, positions = builder.build([], num_tokens_padded=b * self.first_q, num_reqs_padded=b)
        width = self.first_width
        x = dict(
            input_ids=torch.zeros(b * self.first_q, dtype=torch.long, device=dev),
            positions=positions,
            hidden=None
            if width is None
            else torch.zeros(b * self.first_q, width, dtype=self.target_cfg.dtype, device=dev),
            **{f: getattr(meta, f) for f in META_FIELDS},
            sample_rows=torch.zeros(b, dtype=torch.long, device=dev),
            valid=torch.zeros(b, dtype=torch.bool, device=dev),
            slots=torch.full((b,), self.max_num_seqs, dtype=torch.long, device=dev),
            draft_probs=self.draft_probs,
        )
        if sampled:
            x.update(
                temperature=torch.ones(b, device=dev),
                top_k=torch.zeros(b, dtype=torch.long, device=dev),
                top_p=torch.ones(b, device=dev),
                seeds=torch.zeros(b, dtype=torch.long, device=dev),
            )
        return x


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with zero rows appended up to n rows."""
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])
