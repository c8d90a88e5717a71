"""The speculative decoding engine: requests in, steps run, outputs and statistics out.

About 670 lines, one class not split: the public Engine API (add_request / step / generate / stream / abort /
close / stats); the work behind each call lives in the modules it calls (scheduler, step runner, penalties, grammar,
prefix cache, adaptive speculation's controller); what stays here is the glue a step needs (which runner view runs
it, the draft model's catch-up, the step-time calibration of overlapped steps)."""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import torch

from draftgraph import timeline
from draftgraph.compiler.build import CompiledModels
from draftgraph.compiler.config import ResolvedConfig
from draftgraph.compiler.cuda_graphs import StepShapes
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.base import Drafter
from draftgraph.runtime.adaptive import AdaptiveK, BatchLeft
from draftgraph.runtime.dispatcher import Dispatcher
from draftgraph.runtime.kv_cache import BlockAllocator
from draftgraph.runtime.lockstep import Lockstep, LockstepDispatcher
from draftgraph.runtime.memory import MemoryPlan, measure_and_plan
from draftgraph.runtime.prefix_cache import prefix_key
from draftgraph.runtime.request import Request, RequestOutput, SamplingParams
from draftgraph.runtime.scheduler import ScheduledBatch, Scheduler
from draftgraph.runtime.state_cache import attach_state_caches
from draftgraph.runtime.state_snapshots import make_snapshots
from draftgraph.runtime.step import RunnerShape, StepRunner
from draftgraph.runtime.step_times import StepTimes
from draftgraph.runtime.step_writes import StepWrites
from draftgraph.runtime.streaming import StreamDelta, stream_requests
from draftgraph.runtime.text import HOW_TO_GIVE, StopStrings, decode_text, encode_prompt
from draftgraph.runtime.uniform_step import Launched


class Engine:
    """Continuous batching around a StepRunner. Use `generate` for a list of prompts, `stream` to see their
    tokens and text step by step, or `add_request` + `step` to drive it yourself (`abort` drops a request).
    `close()` (or leaving `with compile_model(...) as engine:`) gives back its KV cache, graphs and workers.

    Everything an engine holds is given or made here, at construction (build/engine.py builds the parts);
    nothing outside this module assigns its attributes afterwards. With `prepare` the engine is ready to
    serve when constructed: its KV cache sized from measured memory when `rc.gpu_memory_utilization` is set
    (runtime/memory.py: it starts with a probe cache), every piece compiled and (on CUDA) every graph
    captured, and `warm_up_report` saying how, after the build's `notes`. Without it (tests that drive the
    parts), `warm_up()` and `resize_kv_cache()` are theirs to call."""

    _closed = False  # set by close(); every later call that needs the device refuses

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None,
        rc: ResolvedConfig,
        compiled: CompiledModels | None = None,
        kv_grows_in_place: bool = False,  # caches reserve the device's size, grow at their addresses (growable.py)
        *,
        tokenizer=None,  # runtime/text.py: with one, prompts may be text and outputs carry .text
        build_started: float | None = None,  # time.time() when the build began (artifacts/store.py)
        lockstep_group: str = "",  # runtime/lockstep.py: steps agree with the ranks of this CPU group
        prepare: bool = False,  # size the KV cache, compile and capture now (the class docstring)
        notes: Sequence[str] = (),  # the build's report lines (experts, artifacts), before the warm-up's
    ):
        sized = prepare and bool(rc.gpu_memory_utilization)
        if sized:  # a probe cache (room for one request of max_model_len) until memory is measured
            rc = replace(rc, num_kv_blocks=rc.max_blocks_per_req + 1)
            kv_grows_in_place = True  # where CUDA can (growable.py): the probe's graphs then stay
        self.target, self.drafter, self.config = target, drafter, rc
        self.compiled = compiled  # compiled forwards, graph owner and counters (None in mode NONE)
        self.tokenizer = tokenizer
        self.build_started = build_started
        self.warm_up_report = ""
        self.memory_plan: MemoryPlan | None = None  # set when the KV cache was sized from measurements
        self.k = rc.num_speculative_tokens
        self.allocator = BlockAllocator(rc.num_kv_blocks)
        shape = RunnerShape(
            self.k,
            rc.max_num_seqs,
            rc.max_num_batched_tokens,
            rc.max_blocks_per_req,
            rc.num_kv_blocks,
            rc.block_size,
            rc.capture_sizes,
            rc.one_graph_step,
            kv_grows_in_place and rc.kv_grow_in_place,
            rc.ops.race_sampler,
            rc.synthetic_acceptance,
            ngram=rc.ngram,  # the n-gram drafter (runtime/ngram_state.py): no drafter model, K drafts per step
            max_model_len=rc.max_model_len,
            logits_kernels=rc.ops.logits_kernels,
        )
        hidden = drafter is None or drafter.target_hidden != "none"
        self.shapes = StepShapes(self.k, hidden)
        # Adaptive speculation (runtime/adaptive.py): the K a decode step may pick. A drafter that reads the target's
        # hidden states cannot catch up on steps it skipped, so it never skips one (no K = 0).
        ks = tuple(k for k in rc.speculation_ks if k or not (drafter is not None and hidden))
        query_lens = {q for k in (ks or (self.k,)) for q in StepShapes(k, hidden).full_query_lens}
        dispatcher = Dispatcher(
            rc.mode, rc.capture_sizes, rc.full_capture_sizes, tuple(sorted(query_lens)), graphs=rc.graphs_enabled
        )
        # With a lock-step the target's batches dispatch at the shape the ranks agree on; the drafter's on its own.
        target_dispatcher = LockstepDispatcher(dispatcher, self.shapes.verify) if lockstep_group else dispatcher
        self.runner = StepRunner(
            target, drafter, shape, rc.device, target_dispatcher, self.shapes, compiled, draft_dispatcher=dispatcher
        )
        # Linear-attention layers (Qwen3.5): their per-request state rings; admitted requests get their rows.
        self.states = attach_state_caches(self.runner, rc.max_num_seqs, self.k)
        # One runner per K a step may run at: views of the one runner over its caches and buffers (StepRunner.view).
        self.runners = {k: self.runner.view(k) for k in ks if k != self.k}
        self.runners[self.k] = self.runner
        self.step_times = StepTimes(rc.full_capture_sizes, target, drafter) if len(ks) > 1 else None
        self.adaptive = AdaptiveK(ks, self.step_times, sizes=self.step_times.sizes) if len(ks) > 1 else None
        self._next_k: int | None = None  # an adaptive choice made for a step not relaunched (overlap_steps)
        self._chain: tuple[Launched, float] | None = None  # the step relaunched at the last read, and the read's time
        self._idle_since: float | None = None  # a read that relaunched nothing: the device idles from then (note_gap)
        self._caught_up = False  # the step's runner caught a draft model up (its time is not a step's gap)
        # Prefix caching (runtime/prefix_cache.py): None when off, asked or where it cannot run (logged). A hybrid
        # model's cached prefixes also need state snapshots at their ends (runtime/state_snapshots.py).
        self.snapshots, off = make_snapshots(self.runner, self.states, rc)
        prefix = prefix_key(target, drafter, rc, self.k, off)
        self.scheduler = Scheduler(
            rc.max_num_seqs,
            rc.max_num_batched_tokens,
            self.allocator,
            rc.block_size,
            StepWrites(self.k, 0) if rc.ngram else StepWrites.of(drafter, self.k),  # n-gram: verify rows only
            prefix,
            self.snapshots if prefix is not None else None,
        )
        self._eos = frozenset(target.cfg.eos_token_ids)  # config.json + generation_config.json
        self.last_step_tokens: list[tuple[int, list[int]]] = []  # (request id, ids emitted) of the last step
        self.last_step_logprobs: dict[int, list[dict[int, float]]] = {}  # theirs, for requests that ask
        self._next_id = 0
        self._rng = random.Random(rc.seed)
        self.step_log: list[dict] | None = None  # set to [] to record drafts and emitted tokens per step
        # Steps agreed with other data-parallel ranks (expert parallel), or None.
        self.lockstep = Lockstep(self, lockstep_group, target_dispatcher) if lockstep_group else None
        self._pending: tuple[ScheduledBatch, Launched] | None = None  # a launched step not read yet (overlap_steps)
        self._first_token_marked = False  # the process's start-up timeline (draftgraph/timeline.py)
        self.reset_stats()
        if prepare:
            self._prepare(sized, notes)

    def _prepare(self, sized: bool, notes: Sequence[str]) -> None:
        """The constructor's last part with `prepare`: size the KV cache (`sized`), warm up, report."""
        report, plan = "", None
        if sized:  # measure weights, activations and graphs first, then size the KV cache
            plan, report = measure_and_plan(self, self.config.gpu_memory_utilization)
            self.memory_plan = plan
            timeline.mark("KV sizing")
        if self.compiled is not None and not (plan is not None and plan.kept_graphs):
            report = self.warm_up()
        if self.adaptive is not None and self.compiled is not None and self.config.graphs_enabled:
            from draftgraph.runtime.warmup import measure_step_times, reset_runtime_counters

            report += measure_step_times(self)  # on the cache as sized: every row a request reads its own blocks
            reset_runtime_counters(self)
        if self.memory_plan is not None:
            report = "; ".join(x for x in (report, self.memory_plan.describe()) if x)
        self.warm_up_report = "; ".join(x for x in (*notes, report) if x)

    def warm_up(self, lazy: bool | None = None, largest_only: bool = False) -> str:
        """Compile every piece and (on CUDA) capture every graph, largest size first, or leave capture to the
        steps with lazy capture (`lazy` overrides the config's choice; `largest_only`: only the largest size of
        each kind, which bounds the shared pool); returns the report line."""
        from draftgraph.runtime.warmup import warm_up_and_capture

        return warm_up_and_capture(self, lazy, largest_only)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Both KV caches at `num_blocks` blocks (no request may be running). Graphs read the caches in place:
        unless they grow in place (`runner.kv_grows_in_place`, up to their reservation), release the graphs first
        (`compiled.ctx.release()`) and warm up again after."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("the KV cache can be resized only while no request is running")
        self.config = replace(self.config, num_kv_blocks=num_blocks)
        self.runner.resize_kv_cache(num_blocks)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler.allocator = self.allocator
        if self.snapshots is not None:  # they belonged to the old cache's blocks
            self.snapshots.clear()

    # ---- driving ----------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The target's end-of-sequence ids (config.json and generation_config.json); a request stops at the
        first one it emits unless SamplingParams.ignore_eos."""
        return tuple(self.target.cfg.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (text when the engine has a tokenizer, or token ids); returns its request id."""
        self._check_open("add_request")
        params = params or SamplingParams()
        prompt = self.check_request(prompt, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        req = Request(self._next_id, prompt, params, seed)
        req.stop_ids = (frozenset() if params.ignore_eos else self._eos) | frozenset(params.stop_token_ids)
        if params.stop:
            req.stops = StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output)
        if params.structured is not None:  # runtime/grammar.py: its matcher, compiled for the engine's tokenizer
            req.grammar = self.runner.grammar.matcher(self.tokenizer, params, req.stop_ids, req.id)
        self._next_id += 1
        self.scheduler.add(req)
        return req.id

    def check_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ids (text encoded), or a ValueError naming what does not fit."""
        self._check_open("check_request")
        prompt = encode_prompt(self.tokenizer, prompt)
        if self.config.synthetic_acceptance and params.temperature > 0:
            raise ValueError(
                f"temperature={params.temperature}: this engine pins acceptance (CompileConfig.synthetic_acceptance="
                f"{self.config.synthetic_acceptance}, benchmarks only), which keeps no sampled distribution; use "
                "temperature=0, or build the engine without synthetic_acceptance"
            )
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop)} needs the engine's tokenizer, and it has none; {HOW_TO_GIVE}")
        if params.structured is not None and self.tokenizer is None:
            raise ValueError(
                f"{params.structured[0]} needs the engine's tokenizer, and it has none (a rank of a tensor- or "
                f"data-parallel engine sees token ids only: not supported there yet); {HOW_TO_GIVE}"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} lie outside the vocabulary [0, {vocab}) and can never stop")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias ids {bad[:5]} lie outside the vocabulary [0, {vocab}); use ids below it")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len="
                f"{self.config.max_model_len}; shorten the request or raise CompileConfig.max_model_len"
            )
        self.scheduler.check_fits(len(prompt), params.max_tokens)
        return prompt

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it. With overlapped steps (`overlap_steps`), a
        uniform decode step is launched and read at the next call, after the step that follows it is queued; a
        call whose pending step cannot be followed by the same batch reads it, then schedules and runs a step."""
        self._check_open("step")
        self.last_step_tokens, self.last_step_logprobs = [], {}
        done = []
        if self._pending is not None:
            done = self._step_overlapped()
            if self._pending is not None:  # the next step is queued: this call's step
                return done
        idle, self._idle_since = self._idle_since, None  # (set by the read just made, if it relaunched nothing)
        batch = self.scheduler.schedule()
        self._stats["preemptions"] += batch.num_preempted
        if self.lockstep is not None:  # one step shape with the other ranks; a dummy step when only they have work
            self.lockstep.agree(batch)
        if batch.empty:
            return done
        if self.states is not None:
            self.states.admit(batch.prefills)
            if self.scheduler.snapshots is not None:  # a cached prefix's first block and state
                self.snapshots.admit(batch.prefills)
        t0 = time.perf_counter()
        defer = self.config.overlap_steps and self.lockstep is None and not batch.prefills
        # a grammar's next bitmask needs this step's drafts on the host (runtime/grammar.py): not overlapped
        defer = defer and not any(r.grammar is not None for r in batch.decodes)
        runner = self._runner_for(batch)
        result = runner.run(batch, defer=defer)
        now = time.perf_counter()
        if idle is not None and isinstance(result, Launched) and not self._caught_up and self.step_times.measured:
            # the step before was read and nothing queued after it: the device idled until this launch (in seconds,
            # as the measured step times; the estimate without graphs is in bytes)
            self.adaptive.note_gap(len(batch.decodes), now - idle)
        self._stats["seconds"] += now - t0
        self._stats["steps"] += 1
        self._stats["speculation_histogram"][runner.k] += 1
        if isinstance(result, Launched):  # read at the next call, once the step after it is queued
            self._pending = (batch, result)
            return done
        ends = self._snapshot_ends(batch)  # (rows, before requests finishing in the step give theirs back)
        done += self._apply(batch, result, runner.k)
        if ends:  # after: a boundary's hash may read the token the step sampled
            self._take_snapshots(ends)
        return done

    def _snapshot_ends(self, batch: ScheduledBatch) -> list:
        """Hybrid prefix caching (runtime/state_snapshots.py): the prompt chunks of this step that end on a block
        boundary, as (request, its state row, the boundary)."""
        if self.scheduler.snapshots is None:
            return []
        bs = self.config.block_size
        ends = [(c.req, c.req.slot, c.req.num_computed + c.num_tokens) for c in batch.prefills]
        return [(r, row, e) for r, row, e in ends if e % bs == 0]

    def _take_snapshots(self, ends: list) -> None:
        key, out = self.scheduler.prefix, []
        for r, row, e in ends:
            hashes = key.extend(r.block_table.hashes, r.tokens, e // self.config.block_size)
            if len(hashes) >= e // self.config.block_size:
                out.append((row, e, hashes[e // self.config.block_size - 1]))
        self.snapshots.take(out, self.allocator.is_cached)

    def _runner_for(self, batch: ScheduledBatch) -> StepRunner:
        """The runner of this step's K: the configured one, or with adaptive speculation the controller's choice for
        a pure decode batch; a batch with prompt chunks runs the largest K (its drafter writes their KV), or K = 0
        while tokens/s keeps the controller there (the drafter skipped: it catches up on them later;
        AdaptiveK.prompt_k). The decodes' drafts are fitted to it, and a draft model's KV caught up on the positions
        steps at K = 0 skipped."""
        if self.adaptive is None:
            return self.runner
        k, self._next_k = self._next_k, None
        chunks = batch.prefills
        if chunks or not batch.decodes:
            k = self.adaptive.prompt_k() if 0 in self.runners else self.k
        elif k is None:
            k = self.adaptive.choose(len(batch.decodes), mean_cached(batch.decodes), lambda: self._left(batch.decodes))
        runner = self.runners[k]
        # (a prefill's first chunk lags where its cached blocks lack the draft model's KV: runtime/scheduler.py)
        reqs = batch.decodes + [c.req for c in chunks]
        self._caught_up = False
        if k:
            t0 = time.perf_counter()
            fed = runner.catch_up(reqs)
            self._caught_up = bool(fed)
            if fed:  # timed (the device has nothing else queued here: no step is pending) for the probes' cost
                runner.synchronize()
                self.adaptive.note_catch_up(fed, time.perf_counter() - t0)
            self._stats["catch_up_tokens"] += fed
        elif self.drafter is not None:  # (the n-gram drafter keeps no KV: nothing to catch up)
            for r in reqs:  # the drafter skips these positions: caught up when K returns above 0
                if r.draft_lag < 0:
                    r.draft_lag = r.num_computed
        self._padded = runner.fit_drafts(batch.decodes)
        return runner

    def _step_overlapped(self) -> list[RequestOutput]:
        """Queue the next step of the pending step's requests when nothing about the batch changes (no request
        waits to join, none can reach max_tokens in the pending step, their blocks fit), then read the pending
        step: the host's reading and bookkeeping overlap the queued step on the GPU."""
        batch, launched = self._pending
        self._pending = None
        t0 = time.perf_counter()
        runner = self.runners[launched.key.query_len - 1]  # the verify's query length: 1 + K
        nxt = runner.relaunch(launched) if self._may_relaunch(launched) else None
        result = runner.finish(launched)
        now = time.perf_counter()
        self._stats["seconds"] += now - t0
        if self._chain is not None and self._chain[0] is launched and self.step_times is not None:
            # `launched` ran right after the step read at _chain[1] (queued before it ended): the time between the
            # two reads is its step time on real requests, which corrects the warm-up's measurement on padding
            self.step_times.calibrate(
                runner.k, len(launched.decodes), now - self._chain[1], mean_cached(launched.decodes)
            )
        self._chain = (nxt, now) if nxt is not None else None
        self._idle_since = now if nxt is None and self.adaptive is not None else None
        if nxt is not None:
            self._stats["steps"] += 1
            self._stats["overlapped_steps"] += 1
            self._stats["speculation_histogram"][runner.k] += 1
            self._pending = (batch, nxt)
        done = self._apply(batch, result, runner.k)
        if self._pending is not None and all(r.finish_reason is not None for r in nxt.decodes):
            self._pending = None  # every request stopped in the step just read: the queued one is dropped
            runner.finish(nxt)
            self._stats["dropped_steps"] += 1
        return done

    def _may_relaunch(self, launched: Launched) -> bool:
        """Whether the step after `launched` (not yet read) runs the same batch: nothing waits to join, no
        request may reach max_tokens within `launched` (a stop token still may: its next step is dropped), and
        every request's blocks can hold the next step's rows wherever `launched` leaves it (grown here); with
        adaptive speculation, the K chosen for the next step from the steps read so far is launched's (near a
        request's end the choice waits for the read: its tokens left decide it, runtime/adaptive.py)."""
        if self.scheduler.waiting:
            return False
        k1, writes = launched.key.query_len, self.scheduler.writes  # the most tokens `launched` emits per request
        for r in launched.decodes:  # (before the adaptive choice: the next step's is then made after the read)
            if r.finish_reason is not None or r.params.max_tokens - len(r.output) <= k1:
                return False
        if self.adaptive is not None:  # the choice for the next step, from the steps read so far (up to s - 2),
            d = launched.decodes
            ahead = launched.key.query_len - 1
            self._next_k = self.adaptive.choose(len(d), mean_cached(d), lambda: self._left(d), ahead)
            if self._next_k != ahead:  # (taken by the next step unless relaunched)
                return False
        need = [(r, writes.slots(r.num_computed + k1, writes.decode_rows, True)) for r in launched.decodes]
        if sum(r.block_table.blocks_needed(n) for r, n in need) > self.allocator.num_free:
            return False
        for r, n in need:
            r.block_table.ensure_capacity(n)
        self._next_k = None  # the relaunched step is the one it was chosen for
        return True

    def _left(self, decodes) -> BatchLeft | None:
        """Adaptive speculation: while no request waits to join, the batch ends with its last request, so K is chosen
        for the time to finish them: per request, the tokens it may still emit (up to max_tokens, as read so far; one
        that may stop at a stop token earlier counts to its max_tokens), its slot and id (its own acceptance counts
        are the controller's by slot: runtime/adaptive.py). None while requests wait: a finished one's place is
        taken, and K is chosen for tokens per second."""
        if self.scheduler.waiting:
            return None
        n = len(decodes)
        return BatchLeft(
            np.fromiter((r.params.max_tokens - len(r.output) for r in decodes), dtype=np.float64, count=n),
            np.fromiter((r.slot for r in decodes), dtype=np.int64, count=n),
            np.fromiter((r.id for r in decodes), dtype=np.int64, count=n),
        )

    def _apply(self, batch, result, k: int) -> list[RequestOutput]:
        """A step's outcome into its requests: tokens, drafts, lengths, statistics; the finished ones leave.
        Requests that stopped in the step before (an overlapped step ran them once more) are skipped."""
        for c in batch.prefills:
            c.req.num_computed += c.num_tokens
        done, observed, slots, ids = [], [], [], []
        track = self.adaptive is not None and k > 0  # (a step at K = 0 observes nothing)
        padded, self._padded = self._padded, set()
        for i, req in enumerate(result.sampled):
            if req.finish_reason is not None:
                continue
            emitted = result.emitted[i]
            if i < len(result.accepted):  # a decode: the last token and `accepted` drafts now have KV
                a = result.accepted[i]
                if track and req.id not in padded:  # padded drafts say nothing about the drafter's acceptance
                    observed.append(a)
                    slots.append(req.slot)
                    ids.append(req.id)
                req.num_computed += a + 1
                req.num_verify_steps += 1
                req.num_draft_tokens += k
                req.num_accepted_tokens += a
                self._stats["verify_steps"] += 1
                self._stats["draft_tokens"] += k
                self._stats["accepted_tokens"] += a
                self._stats["acceptance_histogram"][a] += 1
            before = len(req.tokens)
            lps = result.logprobs[i] if result.logprobs is not None else None
            req.append(emitted, req.stop_ids, lps)  # up to the first stop token; what follows it is dropped
            self.last_step_tokens.append((req.id, req.tokens[before:]))
            if req.logprobs is not None:
                self.last_step_logprobs[req.id] = req.logprobs[len(req.logprobs) - (len(req.tokens) - before) :]
            self._stats["generated_tokens"] += len(req.tokens) - before
            if self.step_log is not None:
                self.step_log.append({"request": req.id, "verified": list(req.drafts), "emitted": list(emitted)})
            req.drafts = result.drafts[i]
            if not self._first_token_marked:
                timeline.mark_once("first token")
                self._first_token_marked = True
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                out = req.to_output()
                if self.tokenizer is not None and out.text is None:  # (a stop string's cut text is set)
                    out.text = decode_text(self.tokenizer, out.token_ids)
                done.append(out)
        if track and observed:
            self.adaptive.observe(k, observed, slots=np.array(slots, dtype=np.int64), ids=np.array(ids, dtype=np.int64))
        return done

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[int] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, with a tokenizer, or token ids); request i joins at step
        arrival_steps[i] (all at once by default). Every request is checked before any runs; `stats()` then
        reports this call alone. Outputs carry `.text` when the engine has a tokenizer."""
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for delta in self.stream(prompts, sampling, arrival_steps, progress, detokenize=False):
            if delta.output is not None:
                outputs[delta.index] = delta.output
        return outputs

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[int] | None = None,
        progress: bool = False,
        detokenize: bool = True,
    ) -> Iterator[StreamDelta]:
        """Like `generate`, but yields each request's new tokens (and text) after every step it emits in:
        `StreamDelta(index, request_id, token_ids, text, finish_reason, output)` (runtime/streaming.py).
        Every request is checked before any runs, and `stats()` restarts."""
        return stream_requests(self, prompts, sampling, arrival_steps, progress, detokenize)

    # ---- reporting --------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        """Start the runtime statistics afresh (generate() does at its start); compile counters stay."""
        self._stats = {
            "steps": 0,
            "verify_steps": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "generated_tokens": 0,
            "acceptance_histogram": [0] * (self.k + 1),
            "preemptions": 0,
            "overlapped_steps": 0,  # steps launched before the host read the step before them (overlap_steps)
            "dropped_steps": 0,  # of those, steps whose every request had stopped in the step before
            "seconds": 0.0,
            "speculation_histogram": Counter(),  # K -> steps run at it
            "catch_up_tokens": 0,  # draft-model tokens fed to catch up on K = 0 steps (adaptive speculation)
        }
        self._padded: set[int] = set()  # requests whose drafts the step about to be read padded (fit_drafts)
        self.runner.forwards.reset()
        self.scheduler.reset_stats()
        if self.adaptive is not None:
            self.adaptive.reset_stats()  # (its probes; the K per step is counted above)

    def stats(self) -> dict:
        """What ran since the last generate() call started (or reset_stats(), for callers of step()): steps,
        acceptance, tokens/s, preemptions, forwards per dispatch key. `compile` (when compiled) counts
        since the engine was built: traces, compiles, captures and replays are the engine's, not a call's."""
        self._check_open("stats")
        s = dict(self._stats)
        s["acceptance_histogram"] = list(s["acceptance_histogram"])
        s["acceptance_rate"] = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
        # Tokens per verify step: accepted drafts + the target's own token.
        s["mean_accepted_length"] = 1 + s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
        s["tokens_per_second"] = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
        s["mode"] = self.config.mode.value
        s["num_speculative_tokens"] = self.k
        # K per step: {"mode": "fixed" | "adaptive", "choices", "histogram" {K: steps}, and adaptive's running
        # per-position acceptance rates and draft-model catch-up tokens}
        hist = s.pop("speculation_histogram")
        spec = {"mode": "adaptive" if self.adaptive is not None else "fixed"}
        spec["catch_up_tokens"] = s.pop("catch_up_tokens")
        if self.adaptive is not None:
            spec.update(self.adaptive.stats())
        spec["histogram"] = {k: hist.get(k, 0) for k in sorted(self.runners)}
        s["speculation"] = spec
        s["cuda_graphs"] = self.config.graphs_enabled
        # Pinned acceptance (benchmarks only): the rates that drew every accept decision; None = real acceptance
        s["synthetic_acceptance"] = list(self.config.synthetic_acceptance) or None
        # Which CUDA graph ran each forward: "fn/full/q5/b8", "fn/loop/q5/b8/greedy" (the fused draft loop),
        # "fn/piecewise/t16", or "fn/none" (no graph). In a graph mode, each forward without a graph is also a
        # fallback, counted by the key it was dispatched to (on the CPU: every forward).
        s["dispatch"] = dict(sorted(self.runner.forwards.hits.items()))
        s["fallbacks"] = sum(self.runner.forwards.fallbacks.values())
        s["fallbacks_by_key"] = dict(sorted(self.runner.forwards.fallbacks.items()))
        if self.compiled is not None:
            s["compile"] = self.compiled.counters.as_dict()
            if self.config.lazy_capture:  # graphs appear as steps need them: read the pool now
                s["compile"]["graph_memory_bytes"] = self.compiled.ctx.memory_bytes() or 0
        s["kv_blocks"] = self.config.num_kv_blocks
        # Prompt tokens (and full blocks) looked up in the prefix cache and found there (runtime/prefix_cache.py).
        s["prefix_cache"] = self.scheduler.prefix_stats.as_dict(self.allocator.num_cached, self.allocator.evictions)
        if self.scheduler.snapshots is not None:  # hybrid: the state snapshots (runtime/state_snapshots.py)
            s["prefix_cache"]["state_snapshots"] = self.snapshots.stats()
        if self.memory_plan is not None:
            s["memory"] = self.memory_plan.as_dict()
        return s

    # ---- lifecycle --------------------------------------------------------------------------------

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request: its KV blocks and slot go back now, and it emits nothing more. A step
        already launched with it (overlap_steps) still runs on the device; the next `step` reads and skips it,
        and new work is queued after it on the same stream, so its freed blocks are never written twice.
        Returns False when no unfinished request has that id (it finished, was aborted, or never existed)."""
        sched = self.scheduler
        req = next((r for r in sched.running if r.id == request_id), None)
        if req is not None:
            req.finish_reason = "abort"
            sched.finish(req)
            return True
        req = next((r for r in sched.waiting if r.id == request_id), None)
        if req is None:
            return False
        req.finish_reason = "abort"
        sched.waiting.remove(req)
        if req.block_table is not None:  # a preempted request released its blocks, and keeps its slot
            req.block_table.release()
        if req.slot >= 0:
            sched._free_slots.append(req.slot)
            req.slot = -1
        return True

    @property
    def num_free_kv_blocks(self) -> int:
        """KV cache blocks no request holds."""
        return self.allocator.num_free

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Give back what this engine holds: its unfinished requests are aborted, its CUDA graphs and their
        memory pool dropped, its KV caches unmapped (runtime/growable.py) or freed, a compile pool or kernel
        threads still running stopped, and its compiled code, caches and model references dropped (weights stay
        alive only when the caller holds the models). Idempotent; also run when the engine is collected. Any
        later call that needs the device raises."""
        if self._closed:
            return
        self._closed = True
        cuda = self.config.device.type == "cuda"
        pending, self._pending = self._pending, None
        if pending is not None:  # a launched step still writes the caches: let it finish first
            with contextlib.suppress(Exception):
                self.runners[pending[1].key.query_len - 1].finish(pending[1])
        sched = self.scheduler
        for req in [*sched.running, *sched.waiting]:
            self.abort(req.id)
        compiled, self.compiled = self.compiled, None
        if compiled is not None:
            if compiled.ahead is not None:
                ahead, compiled.ahead = compiled.ahead, None
                with contextlib.suppress(Exception):
                    ahead.close()
            if compiled.pool is not None:
                from draftgraph.compiler.pool.pool_lifetime import release

                pool, compiled.pool = compiled.pool, None
                release(pool)
            if cuda:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.config.device)
            compiled.ctx.release()
        runner, self.runner, self.runners = self.runner, None, {}
        if runner is not None:
            caches = [runner.target_cache] + ([runner.draft_cache] if runner.drafter is not None else [])
            for cache in caches:
                cache.layers[:] = []  # in place: the forwards and graphs' holders share this list
                cache.state = None
                buffers, cache._buffers = cache._buffers, []
                for bufs in buffers:  # unmapped now, whoever still holds a view (no graph may replay on it)
                    for buf in bufs:
                        buf._finalizer()
        self.states = self.snapshots = None
        self.target = self.drafter = None
        if cuda:
            gc.collect()  # the graphs' and caches' reference cycles, so the allocator gets their blocks back
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"this engine is closed; {what}() needs a new engine: dg.compile_model(...) again")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # `del engine` + gc.collect() gives back what close() does (also for an engine __init__ left half-built);
        # not while the interpreter exits (the process gives everything back, and module globals may be gone)
        try:
            if "scheduler" in self.__dict__ and not sys.is_finalizing():
                self.close()
        except Exception:  # noqa: BLE001 - nothing may escape __del__
            pass


def mean_cached(decodes) -> float:
    """The mean cached length of a decode batch (adaptive speculation's step times grow with it)."""
    return sum(r.num_computed for r in decodes) / len(decodes) if decodes else 0.0
