"""`/metrics`: the server's Prometheus metrics, in one registry of its own (prometheus-client).

Counted by the server as requests go (tokens, latency histograms), and read from the engine at each scrape
(`EngineSnapshot`, taken in the engine thread: requests running and waiting, KV blocks, and `engine.stats()`'s
acceptance, steps per K, prefix-cache lookups and per-dispatch-key forwards, which count since the server started).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a millisecond (a decode step on the GPU) to minutes (a long request on the CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def engine_snapshot(engine) -> dict:
    """What /metrics reads from the engine (run in the engine thread); a parallel engine's requests and blocks
    are its replicas' added up (RankedEngine.occupancy)."""
    snap = {"stats": engine.stats()}
    sched = getattr(engine, "scheduler", None)
    if hasattr(engine, "occupancy"):
        snap.update(engine.occupancy())
    elif sched is not None:
        snap["running"], snap["waiting"] = len(sched.running), len(sched.waiting)
        snap["kv_free"] = engine.num_free_kv_blocks
        snap["kv_total"] = engine.config.num_kv_blocks
    return snap


class ServerMetrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        self.model = model
        p = "draftgraph_"
        self.running = Gauge(p + "requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests waiting to join the running batch", registry=r)
        self.inflight = Gauge(p + "requests_in_flight", "requests submitted and not finished", registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV cache blocks free", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter(p + "generation_tokens", "tokens generated and sent", registry=r)
        self.requests = Counter(p + "requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.aborted = Counter(p + "requests_aborted", "requests aborted: client gone, or server stopping", registry=r)
        self.engine_generated = Gauge(p + "engine_generated_tokens", "tokens the engine generated", registry=r)
        self.errors = Counter(p + "request_errors", "requests answered with an error", ["status"], registry=r)
        self.acceptance_rate = Gauge(p + "spec_acceptance_rate", "accepted / proposed draft tokens", registry=r)
        self.mean_accepted = Gauge(
            p + "spec_mean_accepted_length", "tokens per verify step (accepted drafts + 1)", registry=r
        )
        self.verify_steps = Gauge(p + "spec_verify_steps", "verify steps (one per request per step)", registry=r)
        self.draft_tokens = Gauge(p + "spec_draft_tokens", "draft tokens proposed", registry=r)
        self.accepted_tokens = Gauge(p + "spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.by_position = Gauge(
            p + "spec_acceptance_by_position",
            "share of verify steps whose draft at this position (0-based) was accepted",
            ["position"],
            registry=r,
        )
        self.steps_by_k = Gauge(p + "spec_steps_by_k", "engine steps by the drafts K each verified (adaptive "
                                "speculation picks K per step)", ["k"], registry=r)  # fmt: skip
        self.forwards = Gauge(
            p + "forwards", "forwards run, by dispatch key (which CUDA graph, or none)", ["key"], registry=r
        )
        self.fallbacks = Gauge(p + "graph_fallbacks", "forwards without a graph in a graph mode, by key", ["key"],
                               registry=r)  # fmt: skip
        self.steps = Gauge(p + "engine_steps", "engine steps run", registry=r)
        self.prefix_query = Gauge(p + "prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache",
                                  registry=r)  # fmt: skip
        self.prefix_hit = Gauge(p + "prefix_cache_hit_tokens", "prompt tokens found in the prefix cache (not "
                                "prefilled)", registry=r)  # fmt: skip
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)  # fmt: skip
        self.tpot = Histogram(p + "time_per_output_token_seconds", "time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "end-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip

    def observe_request(self, ttft: float | None, e2e: float, num_tokens: int, finish_reason: str) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_tokens > 1:
                self.tpot.observe((e2e - ttft) / (num_tokens - 1))
        self.e2e.observe(e2e)
        self.requests.labels(finish_reason).inc()

    def render(self, snap: dict, inflight: int) -> bytes:
        """The Prometheus text, after setting the gauges from an engine snapshot."""
        self.inflight.set(inflight)
        if "running" in snap:
            self.running.set(snap["running"])
            self.waiting.set(snap["waiting"])
            self.kv_free.set(snap["kv_free"])
            self.kv_used.set(snap["kv_total"] - snap["kv_free"])
        s = snap["stats"]
        self.acceptance_rate.set(s.get("acceptance_rate", 0.0))
        self.mean_accepted.set(s.get("mean_accepted_length", 0.0))
        self.draft_tokens.set(s.get("draft_tokens", 0))
        self.verify_steps.set(s.get("verify_steps", 0))
        self.accepted_tokens.set(s.get("accepted_tokens", 0))
        self.steps.set(s.get("steps", 0))
        prefix = s.get("prefix_cache", {})
        self.prefix_query.set(prefix.get("query_tokens", 0))
        self.prefix_hit.set(prefix.get("hit_tokens", 0))
        self.engine_generated.set(s.get("generated_tokens", 0))
        hist, verify = s.get("acceptance_histogram", []), s.get("verify_steps", 0)
        for i in range(max(len(hist) - 1, 0)):  # position i accepted in the steps that accepted more than i
            self.by_position.labels(str(i)).set(sum(hist[i + 1 :]) / verify if verify else 0.0)
        for k, n in s.get("speculation", {}).get("histogram", {}).items():
            self.steps_by_k.labels(str(k)).set(n)
        for key, n in s.get("dispatch", {}).items():
            self.forwards.labels(key).set(n)
        for key, n in s.get("fallbacks_by_key", {}).items():
            self.fallbacks.labels(key).set(n)
        return generate_latest(self.registry)
