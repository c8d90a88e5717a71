"""One speculative decoding step on the device: verify, accept, propose; one copy to the host at the end.

Flat batch layout: decode requests first (each [last token, d1..dK] at positions n..n+K), then prefill
chunks. The target runs once over all rows. Acceptance happens on the device, and so does everything
that depends on it: the drafter's proposal (runtime/proposer.py) reads the accepted counts on the
device, so no host work sits between verify and the K draft steps.

Both caches use the same block tables: drafter row i lives at the same slot as target position i.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from draftgraph.compiler.build import CompiledModels
from draftgraph.compiler.config import CUDAGraphMode
from draftgraph.compiler.cuda_graphs import StepShapes
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.base import Drafter
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatcher
from draftgraph.runtime.drafting import advance
from draftgraph.runtime.forwards import Forwards
from draftgraph.runtime.grammar import GrammarState
from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache
from draftgraph.runtime.logprobs import RowLogprobs, gather_logprobs, packed_size, unpack
from draftgraph.runtime.ngram_state import NgramState
from draftgraph.runtime.penalties import PenaltyState
from draftgraph.runtime.proposer import Proposer, Verified
from draftgraph.runtime.rejection import rejection_sample
from draftgraph.runtime.request import Request
from draftgraph.runtime.sampler import SamplingTensors, sample
from draftgraph.runtime.scheduler import ScheduledBatch
from draftgraph.runtime.step_inputs import HostCopy
from draftgraph.runtime.uniform_step import LOGPROBS_SUFFIX, Launched, UniformStep


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
    one_graph_step: bool = False  # uniform decode batches that dispatch FULL run runtime/uniform_step.py
    # The KV caches may grow in place up to what the device could hold (runtime/growable.py), so that the cache
    # sized after capture (runtime/memory.py) keeps the probe's addresses and graphs; where CUDA cannot, ignored.
    kv_grows_in_place: bool = False
    race_kernel: bool = True  # OpChoices.race_sampler: eager draws on CUDA take the Triton race (sampler.py)
    synthetic_acceptance: tuple[float, ...] = ()  # pinned acceptance rates (benchmarks; runtime/rejection.py)
    ngram: tuple[int, int] | None = None  # the n-gram drafter's (n_min, n_max) (runtime/ngram_state.py), no model
    max_model_len: int = 0  # the n-gram drafter's history length
    logits_kernels: bool = True  # OpChoices.logits_kernels: penalties and logprobs on CUDA in Triton (ops/logits)


def _reserve_blocks(device: torch.device, target: KVCacheSpec, draft: KVCacheSpec | None) -> int:
    """Blocks of both caches the whole device could hold: the address space each cache tensor reserves (0 where
    this process cannot grow buffers in place)."""
    from draftgraph.runtime.growable import available

    if not available(device):
        return 0
    per_block = target.bytes_per_block + (draft.bytes_per_block if draft is not None else 0)
    return torch.cuda.get_device_properties(device).total_memory // max(per_block, 1) + 1


@dataclass
class StepResult:
    """Host copies of one step's outcome (index i follows `sampled` order: decodes, then last chunks)."""

    sampled: list[Request]
    emitted: list[list[int]]  # tokens each sampled request emits this step
    accepted: list[int]  # accepted drafts per decode request (len = number of decodes)
    drafts: list[list[int]]  # the next K proposals per sampled request
    # When the step gathered logprobs: per sampled request, one per candidate row (aligned with `emitted`)
    logprobs: list[list[RowLogprobs]] | None = None


def wants_logprobs(reqs: list[Request]) -> bool:
    """Host-known: whether a step over `reqs` gathers logprobs (any request asks for them)."""
    return any(r.params.logprobs is not None for r in reqs)


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
        shapes: StepShapes,
        compiled: CompiledModels | None = None,
        draft_dispatcher: Dispatcher | None = None,  # the proposer's, when not `dispatcher` (runtime/lockstep.py)
    ):
        self.target, self.drafter, self.shape, self.shapes = target, drafter, shape, shapes
        self.device = torch.device(device)
        self.dispatcher = dispatcher
        self.draft_dispatcher = draft_dispatcher if draft_dispatcher is not None else dispatcher
        # The callables that run the forwards: the modules themselves (mode NONE) or their compiled forms.
        self.target_fn = compiled.target if compiled else target
        self.drafter_fn = (compiled.drafter if compiled else None) or drafter
        max_tokens = max(shape.max_num_batched_tokens, *shape.capture_sizes, 1)
        self.k = shape.num_speculative_tokens if drafter is not None or shape.ngram else 0
        # The n-gram drafter: per-slot token history and proposal on the device (runtime/ngram_state.py).
        self.ngram = None
        if shape.ngram and self.k:
            self.ngram = NgramState(shape.max_num_seqs, shape.max_model_len, self.k, *shape.ngram, device)
        bs, nb = shape.block_size, shape.num_kv_blocks
        tc = target.cfg
        target_spec = KVCacheSpec.for_model(tc, tc.num_layers, nb, bs)
        draft_spec = KVCacheSpec.for_model(drafter.cfg, drafter.num_kv_layers, nb, bs) if drafter is not None else None
        reserve = _reserve_blocks(self.device, target_spec, draft_spec) if shape.kv_grows_in_place else 0
        traced = bool(compiled)  # mode NONE: no trace reads the caches
        self.target_cache = PagedKVCache(target_spec, self.device, reserve, traced)
        self.target_meta = MetadataBuilder(max_tokens, shape.max_num_seqs, shape.max_blocks_per_req, bs, self.device)
        self.aux_layers: tuple[int, ...] = ()  # target layers whose outputs EAGLE-3 reads
        if drafter is not None:
            self.draft_cache = PagedKVCache(draft_spec, self.device, reserve, traced)
            self.hidden_kind = drafter.target_hidden != "none"
            self.aux_layers = drafter.aux_layers if drafter.target_hidden == "aux" else ()
        self.forwards = Forwards(
            self.target_fn,
            self.drafter_fn,
            self.target_cache.layers,
            self.draft_cache.layers if drafter is not None else None,
            self.aux_layers,
            compiled.whole_graphs if compiled else None,
            graph_mode=dispatcher.mode != CUDAGraphMode.NONE,
        )
        self.proposer = None
        if drafter is not None:
            if not self.hidden_kind:  # a draft model's step 1 has a row more per request
                self.draft_meta = MetadataBuilder(
                    max_tokens + shape.max_num_seqs, shape.max_num_seqs, shape.max_blocks_per_req, bs, self.device
                )
            self.proposer = Proposer(
                drafter,
                tc,
                self.k,
                bs,
                shape.max_num_seqs,
                self.target_meta,
                getattr(self, "draft_meta", None),
                self.forwards,
                draft_dispatcher if draft_dispatcher is not None else dispatcher,
                self.device,
                shapes,
                compiled.loops if compiled and self.k else None,
                race_kernel=shape.race_kernel,
            )
        rows = shape.max_num_seqs * (self.k + 1)  # verify rows (with logprobs: each row's gather too)
        capacity = shape.max_num_seqs * (2 * self.k + 2) + packed_size(rows, tc.vocab_size)
        self.host = HostCopy(capacity, self.device)  # the step's one wait
        # per-slot logits processing
        self.penalties = PenaltyState(shape.max_num_seqs, tc.vocab_size, self.device, shape.logits_kernels)
        # Structured output's bitmask rows (runtime/grammar.py): every verify row of the largest padded uniform batch
        grammar_rows = max((*dispatcher.full_reqs, shape.max_num_seqs)) * (self.k + 1)
        self.grammar = GrammarState(grammar_rows, tc.vocab_size, self.device)
        self.uniform = UniformStep(self) if shape.one_graph_step else None

    # ---- views per K (adaptive speculation, runtime/adaptive.py) ---------------------------------

    def view(self, k: int) -> StepRunner:
        """This runner at k < K drafts per step over the same caches, buffers, forwards and dispatcher: its own
        step shapes, the proposer's q rows [:, :k] (and no fused loops: the loop runs around the compiled drafter
        step), its own one-graph step functions (graph keys differ by the verify's query length). k = 0 runs no
        drafter (a draft model's KV is caught up later: `catch_up`)."""
        if not 0 <= k < self.k:
            raise ValueError(f"a view runs fewer drafts than the runner's K={self.k}, not {k}")
        v = copy.copy(self)
        v.k = k
        v.shapes = StepShapes(k, self.shapes.drafter_reads_hidden)
        rates = self.shape.synthetic_acceptance[:k]
        v.shape = replace(self.shape, num_speculative_tokens=k, synthetic_acceptance=rates)
        v.proposer = None
        if self.proposer is not None and k:
            p = copy.copy(self.proposer)
            p.k, p.shapes, p.first_q, p.loops = k, v.shapes, v.shapes.first_draft, None
            p.draft_probs = self.proposer.draft_probs[:, :k]  # the same storage: q rows of the first k drafts
            v.proposer = p
        if self.uniform is not None:
            v.uniform = self.uniform.view(v)
        return v

    @torch.no_grad()
    def catch_up(self, reqs: list[Request]) -> int:
        """A draft model's KV at the positions K = 0 steps skipped (each request's `draft_lag` up to its cached
        length), written by drafter forwards over those tokens, at most max_num_batched_tokens a forward; returns
        the tokens fed. The draft model reads no target state, so its prefill of them is exact."""
        todo = [(r, r.draft_lag, r.num_computed) for r in reqs if 0 <= r.draft_lag < r.num_computed]
        for r in reqs:
            r.draft_lag = -1
        if not todo or self.drafter is None or self.hidden_kind:
            return 0
        budget, fed = self.shape.max_num_batched_tokens, 0
        while todo:
            slices, ids, rest = [], [], []
            for r, start, end in todo:
                n = min(end - start, budget - len(ids))
                if n <= 0 or len(slices) == self.shape.max_num_seqs:
                    rest.append((r, start, end))
                    continue
                slices.append(RequestSlice(r.block_table.blocks, start, n))
                ids += r.tokens[start : start + n]
                if start + n < end:
                    rest.append((r, start + n, end))
            d = self.draft_dispatcher.dispatch(BatchDescriptor(len(ids), len(slices), None))
            meta, positions = self.draft_meta.build(slices, num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
            ids += [0] * (d.num_tokens - len(ids))
            tok = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
            self.forwards.drafter(d, tok, positions, None, meta)
            fed += sum(x.query_len for x in slices)
            todo = rest
        return fed

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing a catch-up: runtime/engine.py)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fit_drafts(self, decodes: list[Request]) -> set[int]:
        """Each decode's drafts cut or padded to this runner's K (the last step may have run at another K); returns
        the ids of the requests padded. Padding repeats the last token: a greedy row keeps it only where the target
        chooses it, and a sampled row's q there is made one-hot at it (as the n-gram drafter's padding), so it is
        accepted with probability p(token) and the recovery draw leaves it out: exact."""
        k, padded, onehot = self.k, set(), []
        for r in decodes:
            n = len(r.drafts)
            if n > k:
                r.drafts = r.drafts[:k]
            elif n < k:
                fill = r.tokens[-1]
                r.drafts = [*r.drafts, *([fill] * (k - n))]
                padded.add(r.id)
                if r.params.temperature > 0 and self.proposer is not None:
                    onehot += [(r.slot, i, fill) for i in range(n, k)]
        if onehot:  # q of the padded positions (eager, at a change of K only)
            slot, pos, tok = (torch.tensor(c, device=self.device) for c in zip(*onehot))
            q = self.proposer.draft_probs
            q[slot, pos] = 0.0
            q[slot, pos, tok] = 1.0
        return padded

    # ---- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, batch: ScheduledBatch, defer: bool = False) -> StepResult | Launched:
        """Run `batch`'s step and read its outcome; with `defer`, a uniform batch's one-graph step is only
        launched (a `Launched` that `finish` reads later, after `relaunch` may have queued the next step)."""
        k, dev = self.k, self.device
        decodes, chunks = batch.decodes, batch.prefills
        last_chunks = [c for c in chunks if c.last]
        sampled = decodes + [c.req for c in last_chunks]
        nd = len(decodes)
        # A request just admitted (new, or recomputed after a preemption) gets its slot's penalty state.
        self.penalties.admit([c.req for c in chunks if c.first])  # their first chunk may start after a cached prefix
        if self.ngram is not None:  # and their n-gram history: prompt (and output when recomputed)
            self.ngram.admit([c.req for c in chunks if c.first])
        if any(r.grammar is not None for r in decodes):  # runtime/grammar.py: refused drafts -> forced tokens
            self.grammar.repair(decodes, self.proposer.draft_probs if self.proposer is not None else None)

        uniform = self.shapes.verify if nd and not chunks else None  # every request verifies 1 + K tokens
        if uniform is not None and self.uniform is not None:
            d = self.dispatcher.dispatch(BatchDescriptor(nd * uniform, nd, uniform))
            if self.uniform.applies(d):
                launched = self.uniform.launch(decodes, d)
                return launched if defer else self.finish(launched)
        if self.uniform is not None:  # requests may join, leave or lose their blocks in a step the rows do not see
            self.uniform.tables.invalidate()

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
        raw_logits = logits  # logprobs keep the raw logits
        penalties = any(r.params.uses_logits_processing for r in sampled)
        if penalties:  # runtime/penalties.py: verify row i after drafts 0..i-1, a last chunk's row alone
            slots_t = torch.tensor([r.slot for r in sampled], dtype=torch.long).to(dev, non_blocking=True)
            drafts_t = input_ids[: nd * (k + 1)].view(nd, k + 1)[:, 1:] if k else None
            dec_p = self.penalties.process(logits[: nd * (k + 1)].view(nd, k + 1, vocab), slots_t[:nd], drafts_t)
            pre_p = self.penalties.process(logits[nd * (k + 1) :, None], slots_t[nd:], None)[:, 0]
            logits = torch.cat([dec_p.view(nd * (k + 1), vocab), pre_p])
        if any(r.grammar is not None for r in sampled):  # runtime/grammar.py: verify row i after drafts 0..i-1
            self.grammar.fill([(r, k + 1) for r in decodes] + [(c.req, 1) for c in last_chunks], logits.shape[0])
            logits = self.grammar.apply(logits)
        dec_logits = logits[: nd * (k + 1)].view(nd, k + 1, vocab)
        dec_pos = positions[: nd * (k + 1)].view(nd, k + 1) + 1  # positions the verify rows predict
        if k:
            draft_ids = input_ids[: nd * (k + 1)].view(nd, k + 1)[:, 1:]
            q = None
            if not st_dec.all_greedy and self.ngram is None:  # n-gram drafts: one-hot q (q None, rejection.py)
                q = self.proposer.probs_for([r.slot for r in decodes])
            dec_tokens, accepted = rejection_sample(dec_logits, draft_ids, q, st_dec, dec_pos, self.shape.race_kernel,
                                                    self.shape.synthetic_acceptance)  # fmt: skip
        else:
            dec_tokens = sample(dec_logits[:, 0], st_dec, dec_pos[:, 0], self.shape.race_kernel)[:, None]
            accepted = torch.zeros(nd, dtype=torch.long, device=dev)
        pre_pos = positions[torch.tensor(last_rows, dtype=torch.long).to(dev, non_blocking=True)] + 1
        pre_tokens = sample(logits[nd * (k + 1) :], st_pre, pre_pos, self.shape.race_kernel)
        y = torch.cat([dec_tokens.gather(1, accepted[:, None])[:, 0], pre_tokens])  # [Bs] each request's new token
        if penalties:  # the emitted tokens join their slots' counts
            self.penalties.record(slots_t[:nd], dec_tokens, accepted + 1)
            self.penalties.record(slots_t[nd:], pre_tokens[:, None], torch.ones_like(pre_tokens))

        parts = [dec_tokens.flatten(), accepted, pre_tokens]
        with_lp = wants_logprobs(sampled)
        if with_lp:  # every sampled row's logprobs at the token it emits (before the drafts: a fixed offset)
            chosen = torch.cat([dec_tokens.flatten(), pre_tokens])
            parts.append(gather_logprobs(raw_logits, chosen, self.shape.logits_kernels))
        if self.ngram is not None and sampled:  # the emitted tokens join the histories, then the lookup
            slots_ng = torch.tensor([r.slot for r in sampled], dtype=torch.long).to(dev, non_blocking=True)
            self.ngram.record(slots_ng[:nd], dec_tokens, accepted + 1)
            self.ngram.record(slots_ng[nd:], pre_tokens[:, None], torch.ones_like(pre_tokens))
            parts.append(self.ngram.propose(slots_ng)[:, :k].flatten())  # a view's K: the first k (adaptive)
        elif k and self.ngram is None and (sampled or chunks):  # drafter KV for prompt chunks is written anyway
            v = Verified(sampled, decodes, chunks, chunk_rows, ids, input_ids, positions, meta, hidden, aux, accepted,
                         y, st, d)  # fmt: skip
            # the drafts get the target's processing (runtime/penalties.py; a reduced draft vocabulary at its
            # target ids: drafting.Chooser.processed)
            process = self.penalties.process_draft if penalties and self.proposer.processes_drafts else None
            parts.append(self.proposer.propose(v, process).flatten())
        host = self.host.fetch(torch.cat(parts))  # the step's one device -> host copy

        dec_flat, host = host[: nd * (k + 1)], host[nd * (k + 1) :]
        acc, host = host[:nd], host[nd:]
        pre, host = host[: len(last_chunks)], host[len(last_chunks) :]
        emitted = [dec_flat[i * (k + 1) : i * (k + 1) + acc[i] + 1] for i in range(nd)] + [[t] for t in pre]
        lps = None
        if with_lp:
            num_rows, vocab = nd * (k + 1) + len(last_chunks), logits.shape[-1]
            rows_lp = unpack(host, num_rows, vocab)
            host = host[packed_size(num_rows, vocab) :]
            lps = [rows_lp[i * (k + 1) : i * (k + 1) + acc[i] + 1] for i in range(nd)]
            lps += [[rows_lp[nd * (k + 1) + j]] for j in range(len(last_chunks))]
        drafts = [host[i * k : (i + 1) * k] for i in range(len(sampled))] if k else [[] for _ in sampled]
        return StepResult(sampled, emitted, acc, drafts, lps)

    @torch.no_grad()
    def relaunch(self, last: Launched) -> Launched:
        """The next one-graph step of `last`'s requests, queued before `last` is read (UniformStep.relaunch)."""
        return self.uniform.relaunch(last)

    def finish(self, launched: Launched) -> StepResult:
        """Wait for a launched step's packed result (the step's one wait) and unpack it."""
        host = self.host.wait(launched.ticket)
        return self._uniform_result(launched.decodes, host, launched.num_reqs, launched.key.variant)

    def _uniform_result(self, decodes, host: list[int], b: int, variant: str) -> StepResult:
        """StepResult from the one-graph step's packed result [accepted | tokens | drafts | logprobs] at b padded
        requests (logprobs in the `*_logprobs` variants: runtime/logprobs.py)."""
        k, nd = self.k, len(decodes)
        n_tok = b * (k + 1)
        acc, toks, drafts = host[:b], host[b : b + n_tok], host[b + n_tok : b + n_tok + b * k]
        emitted = [toks[i * (k + 1) : i * (k + 1) + acc[i] + 1] for i in range(nd)]
        lps = None
        if variant.endswith(LOGPROBS_SUFFIX):
            rows_lp = unpack(host[b + n_tok + b * k :], n_tok, self.target.cfg.vocab_size)
            lps = [rows_lp[i * (k + 1) : i * (k + 1) + acc[i] + 1] for i in range(nd)]
        return StepResult(decodes, emitted, acc[:nd], [drafts[i * k : (i + 1) * k] for i in range(nd)], lps)

    @property
    def kv_grows_in_place(self) -> bool:
        return self.target_cache.grows_in_place

    @property
    def kv_mapped_bytes(self) -> int:
        """Device memory both caches map outside torch's allocator (when they grow in place)."""
        return self.target_cache.mapped_bytes + (self.draft_cache.mapped_bytes if self.drafter is not None else 0)

    @property
    def kv_num_tensors(self) -> int:
        return self.target_cache.num_tensors + (self.draft_cache.num_tensors if self.drafter is not None else 0)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Both caches at `num_blocks` blocks, in place (the forwards hold the same layer lists); at the same
        addresses when they grow in place."""
        self.shape = replace(self.shape, num_kv_blocks=num_blocks)
        self.target_cache.resize(num_blocks)
        if self.drafter is not None:
            self.draft_cache.resize(num_blocks)

    # ---- capture --------------------------------------------------------------------------------

    @torch.no_grad()
    def dummy_run(self, num_tokens: int) -> None:
        """Run every compiled forward once at `num_tokens` with padding rows only (nothing is written,
        nothing is visible): compiles on the first call, captures graphs while capture is allowed."""
        dev = self.device
        meta, positions = self.target_meta.build([], num_tokens_padded=num_tokens, num_reqs_padded=1)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self.target_fn(ids, positions, meta, self.target_cache.layers, self.aux_layers)
        if self.drafter is None:
            return
        for width in self.proposer.hidden_widths:
            hidden = None if width is None else torch.zeros(num_tokens, width, dtype=self.target.cfg.dtype, device=dev)
            self.drafter_fn(ids, positions, hidden, meta, self.draft_cache.layers)

    @torch.no_grad()
    def dummy_run_full(self, num_reqs: int) -> None:
        """Capture (while allowed) the FULL graphs of `num_reqs` padded requests: the target's verify (or
        decode) shape; the fused draft loops (greedy and sampled) or, without them, the drafter's
        first-step shape; and the drafter's one-row-per-request shape (mixed batches' later steps)."""
        dev = self.device
        q = self.shapes.verify
        d = self.dispatcher.dispatch(BatchDescriptor(num_reqs * q, num_reqs, q))
        one_graph = self.uniform is not None and self.uniform.applies(d)
        if one_graph:  # verify, acceptance and the fused loop: one graph per variant
            self.uniform.dummy(num_reqs)
        elif d.runtime == "FULL":
            meta, positions = self.target_meta.build([], num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
            self.forwards.target(d, torch.zeros(d.num_tokens, dtype=torch.long, device=dev), positions, meta)
        if self.proposer is None:  # no drafter, or a K = 0 view (runtime/adaptive.py)
            return
        shapes = []
        if one_graph:
            pass  # the first step and the loop live in the step's graphs
        elif self.proposer.loops is not None:
            self.proposer.dummy_loops(num_reqs)
        else:
            shapes.append((self.proposer.first_q, self.proposer.first_width))
        shapes.append((self.shapes.later_draft, self.proposer.step_width))
        for q, width in shapes:
            d = self.dispatcher.dispatch(BatchDescriptor(num_reqs * q, num_reqs, q))
            if d.runtime != "FULL":
                continue
            # The same kind of tensors the step passes: builder views, or on-device metadata (later steps).
            if q == self.shapes.later_draft:
                tables = torch.zeros(d.num_reqs, self.shape.max_blocks_per_req, dtype=torch.int32, device=dev)
                no_pos = torch.zeros(d.num_reqs, dtype=torch.long, device=dev)
                positions, meta = advance(tables, no_pos, no_pos > 0, self.shape.block_size)
            else:
                builder = self.target_meta if self.hidden_kind else self.draft_meta
                meta, positions = builder.build([], num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
            ids = torch.zeros(d.num_tokens, dtype=torch.long, device=dev)
            hidden = (
                None if width is None else torch.zeros(d.num_tokens, width, dtype=self.target.cfg.dtype, device=dev)
            )
            self.forwards.drafter(d, ids, positions, hidden, meta)
