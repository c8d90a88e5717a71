"""The whole speculative step of a uniform decode batch as one function, captured as one CUDA graph.

When every request verifies 1 + K tokens and the batch dispatches FULL, one function runs on the device:
the target's verify forward, the LM head on every verify row, greedy or probabilistic acceptance (recovery
and bonus tokens), the drafter's first step over the accepted tokens and its K - 1 later steps (the fused
loop, or the loop around the drafter step), and it returns one packed int64 tensor:

    [accepted (B) | verify tokens (B x (K + 1)) | drafts (B x K) | logprobs (the `*_logprobs` variants)]

In FULL modes on CUDA it is one graph per (padded request count, variant): `GraphKey.step`, variants
"greedy" (every request greedy, known on the host) and "sample", and the same two with "_logprobs" when a
request of the batch asks for logprobs: every verify row's gather (runtime/logprobs.py) joins the packed result.
When a request of the batch asks for logit bias, min_tokens or penalties, the "_penalties" variants (before
"_logprobs") process the verify logits (runtime/penalties.py, each row counting the drafts before it), count
the emitted tokens in the slot buffers, and process each draft step's logits as the next verify's row. When a
request asks for structured output, the "_grammar" variants (after "_penalties", before "_logprobs") set the
tokens its grammar forbids to -inf on every verify row (the bitmask the host filled before the launch, row i
after drafts 0..i-1: runtime/grammar.py). Only "greedy" and "sample" are
captured at warm-up; every variant with a suffix is captured at the first step that needs it, so engines whose
requests never ask for logprobs, penalties or structured output capture no more graphs than that.
Its inputs are the block tables the device keeps per request slot (`DeviceTables`: only new blocks are sent) and
the step's own named buffers
(`StepBuffers`: input ids, request slots, cached lengths, valid rows, sampling parameters), filled on the host
and sent by one pinned asynchronous copy; the attention metadata of the verify (and of a draft model's first
step) is built inside the graph from them (ops/attention/uniform_metadata.py). The host then waits once, for
the packed result (`HostCopy`). With K = 0 it is plain decoding: forward, LM head and token choice in one graph.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from draftgraph.compiler.build import LOOP_VARIANTS
from draftgraph.compiler.cuda_graphs import GraphKey
from draftgraph.ops.attention.metadata import META_FIELDS
from draftgraph.ops.attention.uniform_metadata import uniform_metadata
from draftgraph.runtime.device_tables import DeviceTables
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatch
from draftgraph.runtime.drafting import SAMPLING_FIELDS, draft_loop
from draftgraph.runtime.grammar import GrammarState
from draftgraph.runtime.logprobs import gather_logprobs
from draftgraph.runtime.penalties import PenaltyState
from draftgraph.runtime.rejection import rejection_sample
from draftgraph.runtime.sampler import SamplingTensors, sample
from draftgraph.runtime.step_inputs import Field, StepBuffers


@dataclass
class Launched:
    """A one-graph step launched on the device: its requests, padded request count, graph key and inputs, and
    the ticket of its packed result's copy to the host (`HostCopy.wait`)."""

    decodes: list
    num_reqs: int
    key: GraphKey
    x: dict
    ticket: tuple | None


# Row sampling parameters when every request is greedy: nothing reads the tensors (all_greedy is host-known).
_GREEDY = SamplingTensors(None, None, None, None, (True,))  # type: ignore[arg-type]
_SAMPLE_PAD = dict(temperature=1.0, top_k=0, top_p=1.0, seeds=0)  # padding rows draw from a plain softmax
LOGPROBS_SUFFIX = "_logprobs"
PENALTIES_SUFFIX = "_penalties"
GRAMMAR_SUFFIX = "_grammar"
# The step's variants: the draft loop's (greedy or sampled; captured at warm-up), each also with logits processing
# (runtime/penalties.py), grammar masks (runtime/grammar.py), logprobs gathered, or any of them together (captured at
# the first step that asks for them).
STEP_VARIANTS = tuple(
    v + p + g + lp
    for v in LOOP_VARIANTS
    for p in ("", PENALTIES_SUFFIX)
    for g in ("", GRAMMAR_SUFFIX)
    for lp in ("", LOGPROBS_SUFFIX)
)


def step_variant(sampled: bool, logprobs: bool, penalties: bool = False, grammar: bool = False) -> str:
    return (
        LOOP_VARIANTS[1 if sampled else 0]
        + (PENALTIES_SUFFIX if penalties else "")
        + (GRAMMAR_SUFFIX if grammar else "")
        + (LOGPROBS_SUFFIX if logprobs else "")
    )


class UniformStep:
    """The one-graph step of `runner` (a StepRunner) for uniform decode batches."""

    def __init__(self, runner):
        self.r = runner
        k, dev = runner.k, runner.device
        max_b = max((*runner.dispatcher.full_reqs, runner.shape.max_num_seqs))
        q = runner.shapes.verify
        self.buffers = StepBuffers(
            [
                Field("input_ids", torch.int64, max_b * q),
                Field("slots", torch.int64, max_b),
                Field("lengths", torch.int64, max_b),
                Field("valid", torch.int64, max_b),
                Field("temperature", torch.float32, max_b),
                Field("top_k", torch.int64, max_b),
                Field("top_p", torch.float32, max_b),
                Field("seeds", torch.int64, max_b),
            ],
            dev,
        )
        self.tables = DeviceTables(runner.shape.max_num_seqs, runner.shape.max_blocks_per_req, dev)
        self.penalties: PenaltyState = runner.penalties
        self.grammar: GrammarState = runner.grammar
        self.fns = {
            v: self._body(
                v.startswith("sample"), v.endswith(LOGPROBS_SUFFIX), PENALTIES_SUFFIX in v, GRAMMAR_SUFFIX in v
            )  # fmt: skip
            for v in STEP_VARIANTS
        }
        self.k = k

    def view(self, runner) -> UniformStep:
        """This step for `runner`, a StepRunner view at fewer drafts (StepRunner.view): the same buffers and device
        block tables (sized for the largest K), its own step functions."""
        v = copy.copy(self)
        v.r, v.k = runner, runner.k
        v.fns = {var: v._body(var.startswith("sample"), var.endswith(LOGPROBS_SUFFIX), PENALTIES_SUFFIX in var,
                              GRAMMAR_SUFFIX in var) for var in STEP_VARIANTS}  # fmt: skip
        return v

    def dispatch_first(self, d: Dispatch) -> Dispatch | None:
        """A draft model's first-step dispatch (K + 2 rows per request) when it pads as the verify does."""
        first_q = self.r.shapes.first_draft
        d1 = self.r.dispatcher.dispatch(BatchDescriptor(d.num_reqs * first_q, d.num_reqs, first_q))
        return d1 if d1.runtime == "FULL" and d1.num_reqs == d.num_reqs else None

    def applies(self, d: Dispatch) -> bool:
        if d.runtime != "FULL":
            return False
        if self.k == 0 or self.r.ngram is not None:  # the n-gram drafter runs no forward (runtime/ngram_state.py)
            return True
        return self.r.proposer.hidden_kind or self.dispatch_first(d) is not None

    # ---- the host side ----------------------------------------------------------------------------

    def inputs(self, decodes, d: Dispatch, sampled: bool) -> dict:
        """Fill every buffer the step reads for `decodes` (padded as `d`) and send them to the device."""
        r, b, buf = self.r, d.num_reqs, self.buffers
        if d.num_tokens != b * r.shapes.verify:
            raise ValueError(f"a uniform step pads {b} requests to {b * r.shapes.verify} rows, not {d.num_tokens}")
        self.tables.update(decodes)
        buf.fill("input_ids", [t for x in decodes for t in (x.tokens[-1], *x.drafts)], d.num_tokens)
        buf.fill("slots", [x.slot for x in decodes], b, pad=self.tables.scratch)
        buf.fill("lengths", [x.num_computed for x in decodes], b)
        buf.fill("valid", [1] * len(decodes), b)
        fields = ["input_ids", "slots", "lengths", "valid"]
        if sampled:
            for f in SAMPLING_FIELDS:
                values = [x.seed for x in decodes] if f == "seeds" else [getattr(x.params, f) for x in decodes]
                buf.fill(f, values, b, pad=_SAMPLE_PAD[f])
            fields += list(SAMPLING_FIELDS)
        x = {"tables": self.tables.tables}
        x.update({f: buf.view(f, d.num_tokens if f == "input_ids" else b) for f in fields})
        buf.upload()
        return x

    def launch(self, decodes, d: Dispatch) -> Launched:
        """Run the step for `decodes` from the host's view of them; its packed result starts its copy to the
        host (`HostCopy.start`), which `Launched.ticket` waits for."""
        sampled = not all(x.params.temperature <= 0 for x in decodes)
        penalties = any(x.params.uses_logits_processing for x in decodes)
        grammar = any(x.grammar is not None for x in decodes)
        variant = step_variant(sampled, any(x.params.logprobs is not None for x in decodes), penalties, grammar)
        x = self.inputs(decodes, d, sampled)
        if grammar:  # the bitmask rows after each request's drafts (never relaunched: runtime/engine.py)
            self.grammar.fill([(r, self.r.shapes.verify) for r in decodes], d.num_reqs * self.r.shapes.verify)
        key = GraphKey.step(self.r.shapes.verify, d.num_reqs, variant)
        return self._replay(Launched(list(decodes), d.num_reqs, key, x, None))

    def relaunch(self, last: Launched) -> Launched:
        """The next step of the same requests, launched before the host has read `last`: the step advanced its
        own inputs (next tokens and lengths) on the device, so nothing is sent but blocks the requests gained
        (their tables must hold this step's rows: runtime/engine.py grows them first)."""
        if GRAMMAR_SUFFIX in last.key.variant:
            raise RuntimeError("a step with a grammar cannot be relaunched: its bitmask needs the last step's drafts")
        self.tables.update(last.decodes)
        return self._replay(Launched(last.decodes, last.num_reqs, last.key, last.x, None))

    def _replay(self, step: Launched) -> Launched:
        graphs = self.r.forwards.graphs
        lazy = step.key.variant not in LOOP_VARIANTS and graphs is not None and graphs.enabled
        # a variant with a suffix is captured at the first step that asks for logprobs or penalties
        with graphs.capturing() if lazy and step.key not in graphs.graphs else contextlib.nullcontext():
            packed = self.r.forwards.step(step.key, step.x, self.fns[step.key.variant])
        step.ticket = self.r.host.start(packed)
        return step

    def dummy(self, num_reqs: int) -> None:
        """Run (capturing while allowed) the greedy and sampled variants at `num_reqs` padded requests, on padding
        only (the others are captured by the first step that needs them)."""
        q = self.r.shapes.verify
        d = self.r.dispatcher.dispatch(BatchDescriptor(num_reqs * q, num_reqs, q))
        if not self.applies(d):
            return
        for variant in LOOP_VARIANTS:
            x = self.inputs([], d, variant.startswith("sample"))
            self.r.forwards.step(GraphKey.step(q, d.num_reqs, variant), x, self.fns[variant])

    # ---- the device side --------------------------------------------------------------------------

    def _body(self, sampled: bool, logprobs: bool, penalties: bool = False, grammar: bool = False):
        def step(x: dict) -> torch.Tensor:
            r, k = self.r, self.k
            ids, slots = x["input_ids"], x["slots"]
            lengths, valid, bs = x["lengths"], x["valid"], r.shape.block_size
            pos, meta = uniform_metadata(x["tables"], slots, lengths, valid, r.shapes.verify, bs)
            b = slots.shape[0]
            hidden, aux = r.forwards.target_fn(ids, pos, meta, r.target_cache.layers, r.aux_layers)
            logits = r.target.compute_logits(hidden)  # every verify row (padding rows too: cheaper than a gather)
            logits = logits.view(b, k + 1, logits.shape[-1])
            predicts = pos.view(b, k + 1) + 1  # the positions the verify rows predict
            st = SamplingTensors(*(x[f] for f in SAMPLING_FIELDS), greedy_rows=(False,)) if sampled else _GREEDY
            draft_ids = ids.view(b, k + 1)[:, 1:]
            # Logits processing sees verify row i after drafts 0..i-1; logprobs keep the raw logits.
            chosen = self.penalties.process(logits, slots, draft_ids if k else None) if penalties else logits
            if grammar:  # row i's bitmask after drafts 0..i-1 (filled by the host before the launch)
                chosen = self.grammar.apply(chosen)
            if not k:
                tokens = sample(chosen[:, 0], st, predicts[:, 0], r.shape.race_kernel)
                accepted = torch.zeros_like(tokens)
                if penalties:
                    self.penalties.record(slots, tokens[:, None], accepted + 1)
                if r.ngram is not None:  # a K = 0 step of the n-gram drafter (adaptive): its history still grows
                    r.ngram.record(slots, tokens[:, None], accepted + 1)
                self._advance(x, accepted, tokens)
                lp = [gather_logprobs(logits[:, 0], tokens, r.shape.logits_kernels)] if logprobs else []
                return torch.cat([accepted, tokens, *lp])
            q = r.proposer.draft_probs[slots] if sampled and r.ngram is None else None  # n-gram: one-hot q
            tokens, accepted = rejection_sample(chosen, draft_ids, q, st, predicts, r.shape.race_kernel,
                                                r.shape.synthetic_acceptance)  # fmt: skip
            if penalties:
                self.penalties.record(slots, tokens, accepted + 1)
            y = tokens.gather(1, accepted[:, None])[:, 0]
            if r.ngram is not None:  # prompt lookup over the slots' histories, with this step's tokens appended
                drafts = r.ngram.step(slots, tokens, accepted + 1)[:, :k]  # a view's K: the first k (adaptive)
            else:
                drafts = self._propose(x, pos, meta, hidden, aux, accepted, y, sampled, penalties)
            lp = []
            if logprobs:
                lp = [gather_logprobs(logits.view(b * (k + 1), -1), tokens.flatten(), r.shape.logits_kernels)]
            packed = torch.cat([accepted, tokens.flatten(), drafts.flatten(), *lp])
            self._advance(x, accepted, torch.cat([y[:, None], drafts], dim=1).flatten())
            return packed

        return step

    @staticmethod
    def _advance(x: dict, accepted: torch.Tensor, next_ids: torch.Tensor) -> None:
        """The step's own inputs for the next step of the same requests, in place: each request's next verify
        tokens (its new token, then its new drafts) and its cached length (+ accepted + 1; padding rows stay at
        0). An overlapped step (`relaunch`) reads them; otherwise the host rewrites them first."""
        lengths = x["lengths"]
        lengths.add_(torch.where(x["valid"] != 0, accepted + 1, torch.zeros_like(accepted)))
        x["input_ids"].copy_(next_ids)

    def _propose(self, x, pos, meta, hidden, aux, accepted, y, sampled: bool, penalties: bool) -> torch.Tensor:
        """The K drafts [B, K] after acceptance: the drafter's first-step tokens from the accepted count, then
        the loop (runtime/proposer.py says which rows the first step reads); with `penalties`, each draft step's
        logits processed as the next verify's row (runtime/penalties.py)."""
        r, k, p = self.r, self.k, self.r.proposer
        ids, slots = x["input_ids"], x["slots"]
        b = slots.shape[0]
        j = torch.arange(k + 2, device=ids.device)[None, :]
        if p.hidden_kind:  # row i pairs the hidden state at i with the token at i + 1
            drafts_pad = torch.cat([ids.view(b, k + 1)[:, 1:], y[:, None]], dim=1)
            tok = torch.where(j[:, : k + 1] < accepted[:, None], drafts_pad, y[:, None]).flatten()
            d_pos, d_meta = pos, meta
            h_in = torch.cat(aux, dim=-1) if p.aux else hidden
        else:  # a draft model: its own tokens n..n+K+1, with y at n+a+1 (K + 2 rows per request)
            dec = torch.cat([ids.view(b, k + 1), torch.zeros_like(y)[:, None]], dim=1)
            tok = torch.where(j == accepted[:, None] + 1, y[:, None], dec).flatten()
            d_pos, d_meta = uniform_metadata(x["tables"], slots, x["lengths"], x["valid"], r.shapes.first_draft,
                                             r.shape.block_size)  # fmt: skip
            h_in = None
        offset = 0 if p.hidden_kind else 1
        sample_rows = torch.arange(b, device=ids.device) * p.first_q + accepted + offset
        valid = x["valid"] != 0
        # The fields are views of one buffer: compiled code given two views of one storage would trace them as
        # aliases (a trace of its own); copies inside the step keep the loop's inputs separate tensors.
        slots = slots.clone()
        sampling = {f: x[f].clone() for f in SAMPLING_FIELDS} if sampled else None
        if p.loops is not None:
            loop = p.loops[1 if sampled else 0]
            flat = {f: getattr(d_meta, f) for f in META_FIELDS}
            return loop(input_ids=tok, positions=d_pos, hidden=h_in, **flat, sample_rows=sample_rows, valid=valid,
                        slots=slots, draft_probs=p.draft_probs, kv_caches=r.draft_cache.layers,
                        **(sampling or {}))  # fmt: skip

        def drafter(ids_, pos_, h_, m_):
            return r.forwards.drafter_fn(ids_, pos_, h_, m_, r.draft_cache.layers)

        process = self.penalties.process_draft if penalties and p.processes_drafts else None
        return draft_loop(drafter, drafter, p.choose, k, p.shift, r.shape.block_size, p.hidden_kind, tok, d_pos, h_in,
                          d_meta, sample_rows, valid, d_meta.block_tables, sampling, slots, p.draft_probs,
                          process)  # fmt: skip
