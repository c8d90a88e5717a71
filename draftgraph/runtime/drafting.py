"""The drafter's K steps as one plain Python loop, run two ways.

`draft_loop` is the loop: the first step over the rows the target verified, the token choice at each
request's sampling row, then K - 1 single-token steps whose positions, slots and visible lengths
advance on the device from the block tables. Nothing in it touches the host, so it can be:

* traced once by Dynamo with the drafter module inside (compiler/compiled_forward.py, `CompiledLoop`)
  and captured as one CUDA graph per padded request count: the fused loop of FULL mode;
* run as written around the compiled drafter step (its split pieces, piece graphs or per-step FULL
  graphs): the K replays of PIECEWISE mode, and mode NONE with the eager drafter.

Both run the same arithmetic in the same order, so they choose the same tokens.

Every row of the loop is a request slot of the padded batch: rows with `valid` False (padding) read
nothing (visible length 0), write no KV (slot -1) and record their sampling probabilities in the
scratch row of `draft_probs`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftgraph.models.drafters.base import Drafter
from draftgraph.ops.attention.metadata import META_FIELDS, AttentionMetadata
from draftgraph.ops.sampling.op import greedy_argmax
from draftgraph.ops.splitting import mark_piece_boundary
from draftgraph.runtime.sampler import SALT_DRAFT, SamplingTensors, probabilities, sample_from_probs

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds")

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, AttentionMetadata], tuple]


def advance(tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Metadata for one token per request at positions `pos` [B] (request i reads row i of `tables`);
    rows where `valid` is False write nothing and see nothing."""
    b = pos.shape[0]
    rows = torch.arange(b, device=pos.device)
    block = tables.gather(1, (pos // block_size)[:, None])[:, 0].long()
    kv_len = torch.where(valid, pos + 1, torch.zeros_like(pos))
    meta = AttentionMetadata(
        slot_mapping=torch.where(valid, block * block_size + pos % block_size, torch.full_like(pos, -1)),
        token_req=rows.int(),
        token_kv_len=kv_len.int(),
        block_tables=tables,
        seq_lens=kv_len.int(),
        query_start_loc=torch.arange(b + 1, device=pos.device).int(),
    )
    return pos, meta


def advance_next(tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, block_size: int):
    """`advance(tables, pos + 1, valid, block_size)`. Run eagerly on CUDA (the loop around the compiled drafter
    step) it is one Triton kernel (ops/attention/triton_advance.py) instead of a dozen small ones; traced, it is
    the torch ops, which Inductor fuses (and where the kernel's row-major table layout does not hold)."""
    if not pos.is_cuda or torch.compiler.is_compiling() or tables.stride(-1) != 1:
        return advance(tables, pos + 1, valid, block_size)
    from draftgraph.ops.attention.triton_advance import advance_next_triton

    pos, slot, req, kv, seq, qsl = advance_next_triton(tables, pos, valid, block_size)
    return pos, AttentionMetadata(slot, req, kv, tables, seq, qsl)


class Chooser:
    """The token choice of one draft step: argmax, or a draw with per-(seed, position) noise whose
    probabilities are kept (at `draft_probs[slots, step]`) for the next verify's rejection sampling."""

    def __init__(self, drafter: Drafter, target_vocab: int, race_kernel: bool):
        self.drafter, self.target_vocab = drafter, target_vocab
        self.race_kernel = race_kernel  # OpChoices.race_sampler (sampler.sample_from_probs)

    def __call__(self, logit_h, rows, pred_pos, step, sampling: dict | None, slots, draft_probs, process=None,
                 prior=()):  # fmt: skip
        """`step`: the draft step's index, a 0-dim tensor when sampling (its column of draft_probs; draft_loop
        passes an int, unused, to greedy choices). `process`: the target's logits processing for drafts
        (PenaltyState.process_draft) applied after the drafts `prior` of this loop, or None."""
        drafter = self.drafter
        logits = drafter.compute_logits(logit_h, rows)
        if process is not None:  # the processing the next verify applies at this draft's row
            logits = self.processed(logits, slots, process, prior)
        greedy_ids = greedy_argmax(logits)
        if sampling is None:  # every request greedy (host-known): no probability work at all
            return drafter.to_target_ids(greedy_ids)
        st = SamplingTensors(**sampling, greedy_rows=())
        q = probabilities(logits, st)
        drawn = sample_from_probs(q, st.seeds, pred_pos, SALT_DRAFT, self.race_kernel)
        col = step.reshape(1)  # [1], broadcast against slots (a 0-dim index would be read as an int)
        draft_probs[slots, col] = drafter.draft_probs_to_target(q, self.target_vocab)
        return drafter.to_target_ids(torch.where(st.temperature <= 0, greedy_ids, drawn))

    def processed(self, logits, slots, process, prior):
        """`process` (over the target's vocabulary) applied to a draft step's logits [B, Vd]. A reduced draft
        vocabulary (EAGLE-3's d2t) is processed inside the target's: its logits placed at their target ids, -inf
        elsewhere (which no processing moves), processed, and read back at the same ids."""
        drafter = self.drafter
        if drafter.draft_vocab_size == self.target_vocab:
            return process(logits, slots, list(prior))
        ids = drafter.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))  # [Vd] target ids
        full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        full[:, ids] = logits
        return process(full, slots, list(prior))[:, ids]


def draft_loop(
    first: StepFn,
    step: StepFn,
    choose: Chooser,
    k: int,
    shift: int,
    block_size: int,
    feed_hidden: bool,
    input_ids,
    positions,
    hidden,
    meta: AttentionMetadata,
    sample_rows,
    valid,
    tables,
    sampling: dict | None,
    slots,
    draft_probs,
    process=None,
) -> torch.Tensor:
    """K draft tokens [B, K] (target ids) for the B rows of `sample_rows` (one per request slot); `process`: the
    logits processing of each draft step after the drafts before it (`Chooser`), or None (raw logits).

    `first` runs over the first step's rows; request i's first draft comes from row sample_rows[i],
    which sits at position p_i, so draft j predicts position p_i + j + shift (shift: 2 for drafters
    that pair the target's hidden at i with the token at i + 1, 1 for a draft model)."""
    next_h, logit_h = first(input_ids, positions, hidden, meta)
    pos = positions[sample_rows]
    h = next_h[sample_rows]
    # The step index and the positions advance as tensors (j and row position + j are never constants):
    # the code between two drafter steps is then the same graph at every step, and compiles once.
    j = torch.zeros((), dtype=torch.long, device=pos.device) if sampling is not None else 0
    out = [choose(logit_h, sample_rows, pos + shift, j, sampling, slots, draft_probs, process)]
    for _ in range(1, k):
        pos, step_meta = advance_next(tables, pos, valid, block_size)
        j = j + 1
        h, logit_h = step(out[-1], pos, h if feed_hidden else None, step_meta)
        out.append(choose(logit_h, None, pos + shift, j, sampling, slots, draft_probs, process, out))
    return torch.stack(out, dim=1)


def fused_loop_fn(drafter: Drafter, choose: Chooser, k: int, block_size: int):
    """The loop with the drafter module itself as every step, over flat tensor arguments plus the drafter's
    KV caches (what Dynamo traces for the fused graph, and what a FULL graph captures); (greedy, sampled)."""
    shift = 2 if drafter.target_hidden != "none" else 1
    feed_hidden = drafter.target_hidden != "none"

    def make(sampled: bool):
        def loop(input_ids, positions, hidden, slot_mapping, token_req, token_kv_len, block_tables, seq_lens,
                 query_start_loc, sample_rows, valid, slots, draft_probs, kv_caches, temperature=None, top_k=None,
                 top_p=None, seeds=None):  # fmt: skip
            def drafter_step(ids, pos, h, meta):
                # Split points around the drafter: its pieces inside the loop are its own (shared compiles).
                mark_piece_boundary(ids, pos, h, *(getattr(meta, f) for f in META_FIELDS))
                out = drafter(ids, pos, h, meta, kv_caches)
                mark_piece_boundary(*out)
                return out

            meta = AttentionMetadata(slot_mapping, token_req, token_kv_len, block_tables, seq_lens, query_start_loc)
            sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds) if sampled else None
            return draft_loop(drafter_step, drafter_step, choose, k, shift, block_size, feed_hidden, input_ids,
                              positions, hidden, meta, sample_rows, valid, block_tables, sampling, slots,
                              draft_probs)  # fmt: skip

        return loop

    return make(False), make(True)
