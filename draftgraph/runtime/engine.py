"""The speculative decoding engine: requests in, steps run, outputs and statistics out."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from tqdm import tqdm

from draftgraph.compiler.capture import CompiledModels, warm_up_and_capture
from draftgraph.compiler.config import ResolvedConfig
from draftgraph.models.drafters.base import Drafter
from draftgraph.models.llama import CausalLM
from draftgraph.runtime.dispatcher import Dispatcher
from draftgraph.runtime.kv_cache import BlockAllocator
from draftgraph.runtime.request import Request, RequestOutput, SamplingParams
from draftgraph.runtime.scheduler import Scheduler
from draftgraph.runtime.step import RunnerShape, StepRunner


class Engine:
    """Continuous batching around a StepRunner. Use `generate` for a list of prompts, or
    `add_request` + `step` to drive it yourself."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None,
        rc: ResolvedConfig,
        target_fn=None,
        drafter_fn=None,
        compiled: CompiledModels | None = None,
    ):
        self.target, self.drafter, self.config = target, drafter, rc
        self.compiled = compiled  # compiled forwards and their counters (None in mode NONE)
        self.warm_up_report = ""
        self.memory_plan = None  # compiler/memory.py's MemoryPlan when the KV cache was sized from measurements
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
        )
        k = self.k
        qs = (1, k + 1, k + 2) if k else (1,)
        dispatcher = Dispatcher(rc.mode, rc.capture_sizes, rc.full_capture_sizes, qs, graphs=rc.graphs_enabled)
        self.runner = StepRunner(
            target,
            drafter,
            shape,
            rc.device,
            dispatcher,
            target_fn,
            drafter_fn,
            compiled.full_target if compiled else None,
            compiled.full_drafter if compiled else None,
            compiled.loops if compiled else None,
        )
        self.scheduler = Scheduler(
            rc.max_num_seqs, rc.max_num_batched_tokens, self.k, self.allocator, rc.block_size, rc.lookahead
        )
        self._eos = frozenset(target.cfg.eos_token_ids)
        self._next_id = 0
        self._rng = random.Random(rc.seed)
        self.step_log: list[dict] | None = None  # set to [] to record drafts and emitted tokens per step
        self._stats = {
            "steps": 0,
            "verify_steps": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "generated_tokens": 0,
            "acceptance_histogram": [0] * (self.k + 1),
            "seconds": 0.0,
        }

    def warm_up(self) -> str:
        """Compile every piece and (on CUDA) capture every graph, largest size first; returns the report line."""
        return warm_up_and_capture(self)

    # ---- driving ----------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len="
                f"{self.config.max_model_len}; shorten the request or raise CompileConfig.max_model_len"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        req = Request(self._next_id, prompt, params, seed)
        self._next_id += 1
        self.scheduler.add(req)
        return req.id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        t0 = time.perf_counter()
        result = self.runner.run(batch)
        self._stats["seconds"] += time.perf_counter() - t0
        self._stats["steps"] += 1
        for c in batch.prefills:
            c.req.num_computed += c.num_tokens
        done = []
        for i, req in enumerate(result.sampled):
            emitted = result.emitted[i]
            if i < len(result.accepted):  # a decode: the last token and `accepted` drafts now have KV
                a = result.accepted[i]
                req.num_computed += a + 1
                req.num_verify_steps += 1
                req.num_draft_tokens += self.k
                req.num_accepted_tokens += a
                self._stats["verify_steps"] += 1
                self._stats["draft_tokens"] += self.k
                self._stats["accepted_tokens"] += a
                self._stats["acceptance_histogram"][a] += 1
            before = len(req.output)
            stop = self._eos if not req.params.ignore_eos else frozenset()
            req.append(emitted, stop | frozenset(req.params.stop_token_ids))
            self._stats["generated_tokens"] += len(req.output) - before
            if self.step_log is not None:
                self.step_log.append({"request": req.id, "verified": list(req.drafts), "emitted": list(emitted)})
            req.drafts = result.drafts[i]
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                done.append(req.to_output())
        return done

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[int] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; request i joins at step arrival_steps[i] (all at once by default)."""
        n = len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        arrivals = list(arrival_steps) if arrival_steps is not None else [0] * n
        if len(params) != n or len(arrivals) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(arrivals)} arrival steps")
        order = sorted(range(n), key=lambda i: arrivals[i])
        ids: dict[int, int] = {}
        outputs: dict[int, RequestOutput] = {}
        step, nxt = 0, 0
        bar = tqdm(total=n, desc="generating", unit="req", disable=not progress)
        while len(outputs) < n:
            while nxt < n and arrivals[order[nxt]] <= step:
                ids[self.add_request(prompts[order[nxt]], params[order[nxt]])] = order[nxt]
                nxt += 1
            if not self.has_unfinished():
                step = arrivals[order[nxt]]  # idle until the next arrival
                continue
            for out in self.step():
                outputs[ids[out.request_id]] = out
                bar.update(1)
            step += 1
        bar.close()
        return [outputs[i] for i in range(n)]

    # ---- reporting --------------------------------------------------------------------------------

    def stats(self) -> dict:
        s = dict(self._stats)
        s["acceptance_histogram"] = list(s["acceptance_histogram"])
        s["acceptance_rate"] = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
        # Tokens per verify step: accepted drafts + the target's own token.
        s["mean_accepted_length"] = 1 + s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
        s["tokens_per_second"] = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
        s["mode"] = self.config.mode.value
        s["num_speculative_tokens"] = self.k
        s["cuda_graphs"] = self.config.graphs_enabled
        # Which CUDA graph ran each forward: "fn/full/q5/b8", "fn/loop/q5/b8/greedy" (the fused draft loop),
        # "fn/piecewise/t16", or "fn/none" (no graph). In a graph mode, each forward without a graph is also a
        # fallback, counted by the key it was dispatched to (on the CPU: every forward).
        s["dispatch"] = dict(sorted(self.runner.forwards.hits.items()))
        s["fallbacks"] = sum(self.runner.forwards.fallbacks.values())
        s["fallbacks_by_key"] = dict(sorted(self.runner.forwards.fallbacks.items()))
        if self.compiled is not None:
            s["compile"] = self.compiled.counters.as_dict()
            if self.config.lazy_capture:  # graphs appear as steps need them: read the pool now
                from draftgraph.compiler.capture import pool_bytes

                s["compile"]["graph_memory_bytes"] = pool_bytes(self.compiled.ctx.pool) or 0
        s["kv_blocks"] = self.config.num_kv_blocks
        if self.memory_plan is not None:
            s["memory"] = self.memory_plan.as_dict()
        return s
