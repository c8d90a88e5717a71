"""Lock-step for data-parallel ranks that must step together (expert parallelism over replicas: every target
forward holds collectives across them, models/parallel/experts.py).

Each rank has its own scheduler and requests. At every `Engine.step`, after scheduling, the ranks agree on
one step shape with one small all-reduce (MAX) of their counts over a CPU (gloo) group, never a device sync:

    [target tokens, requests, mixed batch?, some request samples?, has a batch?, has unfinished requests?]

- The agreed `StepPlan` pads every rank's target forward to the same shape: `LockstepDispatcher` (the runner's
  target dispatcher in an engine with a lock-step) turns a target batch descriptor into (max tokens, max
  requests, the uniform query length only when every busy rank's batch is uniform), so the ranks dispatch the same
  runtime (FULL / PIECEWISE / NONE), pad to the same sizes and replay the same graph keys; the all-gathers
  inside the experts then see equal token counts everywhere.
- A rank with nothing to schedule while another has work runs a dummy step of that shape on padding rows only
  (nothing written, nothing visible): a uniform plan in a FULL mode runs the one-graph step (verify, acceptance
  and the draft loop in one graph) of the agreed variant; otherwise the target's verify forward, then (for a
  drafter reading the target's hidden states) its first draft step over the same rows, as the busy ranks'
  first draft step runs. `dummy_steps` counts them. The drafter holds no expert-parallel collective
  (replicated, or split within its replica only), so its later draft steps need no agreement across replicas.
  With tensor parallelism the TP ranks of a replica vote the same counts (one scheduler, SPMD), so they run
  the same steps, dummy ones too.
- `drain()` steps until no rank has unfinished requests: a rank whose own requests are done keeps answering
  the others' steps (a rank's `generate` ends with it; the driver's `step()` reaches every rank anyway).

The all-reduce costs one CPU collective per step; the draft model's first step and later draft steps
dispatch on the proposer's own (unpadded) dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.compiler.build import LOOP_VARIANTS
from draftgraph.compiler.cuda_graphs import GraphKey
from draftgraph.ops.collectives.op import get_group
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatch, Dispatcher
from draftgraph.runtime.scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepPlan:
    """The shape every rank's target forward takes this step."""

    num_tokens: int  # the largest real target token count over the ranks
    num_reqs: int  # the largest request count
    uniform_query_len: int | None  # every busy rank verifies this many tokens per request; None: some batch mixes
    sampled: bool  # some rank's batch samples (the one-graph step's "sample" variant)
    busy: bool  # some rank has a batch this step
    pending: bool  # some rank has unfinished requests


class LockstepDispatcher:
    """The runner's dispatcher with the step's plan applied to target batch descriptors (query length the
    verify's, or mixed); the drafter's descriptors and calls outside a plan pass through unchanged."""

    def __init__(self, base: Dispatcher, verify_q: int):
        self.base, self.verify_q = base, verify_q
        self.plan: StepPlan | None = None

    def __getattr__(self, name):  # mode, full_reqs, graphs, padded_tokens, ...: the base dispatcher's
        return getattr(self.base, name)

    def dispatch(self, desc: BatchDescriptor) -> Dispatch:
        p = self.plan
        if p is not None and desc.uniform_query_len in (self.verify_q, None):
            q = desc.uniform_query_len if desc.uniform_query_len == p.uniform_query_len else None
            desc = BatchDescriptor(max(desc.num_tokens, p.num_tokens), max(desc.num_reqs, p.num_reqs), q)
        return self.base.dispatch(desc)


class Lockstep:
    """An engine's lock-step, made by the Engine at construction (`Engine(..., lockstep_group=...)`, which
    gives its runner `dispatcher` for the target): its steps then agree with the other ranks of the process
    group registered as `group_name` (a CPU / gloo group)."""

    def __init__(self, engine, group_name: str, dispatcher: LockstepDispatcher):
        self.engine, self.group_name, self.dispatcher = engine, group_name, dispatcher
        self.verify_q = dispatcher.verify_q
        self.plan: StepPlan | None = None
        self.dummy_steps = 0

    def reset(self) -> None:
        self.dummy_steps = 0

    def counts(self, batch: ScheduledBatch) -> list[int]:
        """This rank's vote (see the module docstring)."""
        nd = len(batch.decodes)
        tokens = nd * self.verify_q + sum(c.num_tokens for c in batch.prefills)
        mixed = not batch.empty and (bool(batch.prefills) or not nd)
        sampled = any(r.params.temperature > 0 for r in batch.decodes)
        pending = self.engine.scheduler.has_unfinished()
        return [tokens, nd + len(batch.prefills), int(mixed), int(sampled), int(not batch.empty), int(pending)]

    def agree(self, batch: ScheduledBatch) -> StepPlan:
        """Agree on this step's plan with every rank (each calls it once per step); run a dummy step when this
        rank has no batch and another has one."""
        import torch.distributed as dist

        votes = torch.tensor(self.counts(batch), dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=get_group(self.group_name))
        tokens, reqs, mixed, sampled, busy, pending = votes.tolist()
        uniform = self.verify_q if busy and not mixed else None
        self.plan = StepPlan(tokens, reqs, uniform, bool(sampled), bool(busy), bool(pending))
        self.dispatcher.plan = self.plan if busy else None
        if busy and batch.empty:
            self.dummy_step(self.plan)
            self.dummy_steps += 1
        return self.plan

    def drain(self) -> None:
        """Step until no rank has unfinished requests (this rank's own are done: its steps are dummy ones)."""
        while True:
            self.engine.step()
            if not self.plan.pending:
                return

    @torch.no_grad()
    def dummy_step(self, plan: StepPlan) -> None:
        """The forwards a busy rank runs at `plan`, on padding rows only; then one wait, as a real step's
        (the next step's host buffers are refilled only once this step's copies are done)."""
        self._dummy_forwards(plan)
        dev = self.engine.runner.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _dummy_forwards(self, plan: StepPlan) -> None:
        r = self.engine.runner
        dev, q = r.device, self.verify_q
        if plan.uniform_query_len is not None and r.uniform is not None:
            d = r.dispatcher.dispatch(BatchDescriptor(plan.num_reqs * q, plan.num_reqs, q))
            if r.uniform.applies(d):  # as the busy ranks: the one-graph step
                variant = LOOP_VARIANTS[1 if plan.sampled else 0]
                x = r.uniform.inputs([], d, plan.sampled)
                r.forwards.step(GraphKey.step(q, d.num_reqs, variant), x, r.uniform.fns[variant])
                return
        d = r.dispatcher.dispatch(BatchDescriptor(plan.num_tokens, plan.num_reqs, plan.uniform_query_len))
        meta, positions = r.target_meta.build([], num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
        ids = torch.zeros(d.num_tokens, dtype=torch.long, device=dev)
        hidden, aux = r.forwards.target(d, ids, positions, meta)
        p = r.proposer
        if p is not None and p.hidden_kind:  # the first draft step runs on the target's rows and dispatch
            r.forwards.drafter(d, ids, positions, torch.cat(aux, dim=-1) if p.aux else hidden, meta)
