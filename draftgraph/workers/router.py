"""Data parallelism on the driver's side: which replica runs each request, the driver's request ids, and the
replicas' statistics added up.

Policy: least loaded. A request goes to the replica with the fewest unfinished requests the driver gave it
(ties to the lowest replica), so a `generate` call's prompts go round-robin and `add_request` fills the
replica that has finished most. Each replica numbers its requests itself; the driver gives every request its
own id (in the order it was given) and maps the replicas' outputs back to it.
"""

from __future__ import annotations

from collections import Counter

from draftgraph.runtime.request import RequestOutput

# Counters a replica reports that add up over replicas (`seconds`: the longest replica's, they run side by side).
SUMMED = (
    "steps",
    "verify_steps",
    "draft_tokens",
    "accepted_tokens",
    "generated_tokens",
    "preemptions",
    "fallbacks",
    "dummy_steps",
    "overlapped_steps",
    "dropped_steps",
)


class Router:
    def __init__(self, num_replicas: int):
        self.load = [0] * num_replicas  # unfinished requests given through add_request, per replica
        self._next_id = 0
        self._ids: dict[tuple[int, int], int] = {}  # (replica, the replica's request id) -> the driver's id

    def pick(self, load: list[int] | None = None) -> int:
        load = self.load if load is None else load
        return min(range(len(load)), key=lambda d: (load[d], d))

    def spread(self, n: int) -> list[int]:
        """The replica of each of n requests given at once (a generate call): least loaded, one at a time."""
        load, out = list(self.load), []
        for _ in range(n):
            d = self.pick(load)
            load[d] += 1
            out.append(d)
        return out

    def admit(self, replica: int, local_id: int) -> int:
        """The driver's id of a request the replica queued as `local_id`."""
        rid = self._next_id
        self._next_id += 1
        self._ids[(replica, local_id)] = rid
        self.load[replica] += 1
        return rid

    def new_ids(self, n: int) -> list[int]:
        """Ids for n requests that finish within one call (generate)."""
        first = self._next_id
        self._next_id += n
        return list(range(first, first + n))

    def global_id(self, replica: int, local_id: int) -> int:
        return self._ids[(replica, local_id)]

    def locate(self, rid: int) -> tuple[int, int] | None:
        """(replica, the replica's id) of the driver's unfinished request `rid` given through add_request; None
        when there is none (it finished, was aborted, or never existed)."""
        return next((key for key, g in self._ids.items() if g == rid), None)

    def dropped(self, replica: int, local_id: int) -> None:
        """The replica's request `local_id` was aborted: it leaves the replica's load."""
        if self._ids.pop((replica, local_id), None) is not None:
            self.load[replica] -= 1

    def finished(self, replica: int, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The replica's finished outputs under the driver's ids (their requests leave its load)."""
        for out in outputs:
            out.request_id = self._ids.pop((replica, out.request_id))
            self.load[replica] -= 1
        return outputs


def merge_stats(replicas: list[dict]) -> dict:
    """One replica's stats for all: counters summed, `seconds` the longest, rates recomputed from the sums;
    engine facts (mode, K, compile counters, KV blocks, memory) are replica 0's; `per_replica` lists each."""
    s = dict(replicas[0])
    for key in SUMMED:
        s[key] = sum(r.get(key, 0) for r in replicas)
    s["acceptance_histogram"] = [sum(col) for col in zip(*(r["acceptance_histogram"] for r in replicas))]
    s["seconds"] = max(r["seconds"] for r in replicas)
    for key in ("dispatch", "fallbacks_by_key"):
        total: Counter = Counter()
        for r in replicas:
            total.update(r[key])
        s[key] = dict(sorted(total.items()))
    if all("prefix_cache" in r for r in replicas):  # each replica's own cache: lookups and blocks added up
        pc = dict(replicas[0]["prefix_cache"])
        for key in (
            "query_tokens",
            "hit_tokens",
            "query_blocks",
            "hit_blocks",
            "cached_blocks",
            "evictions",
            "prefill_tokens",
        ):
            pc[key] = sum(r["prefix_cache"].get(key, 0) for r in replicas)
        pc["hit_rate"] = pc["hit_tokens"] / pc["query_tokens"] if pc["query_tokens"] else 0.0
        if all("state_snapshots" in r["prefix_cache"] for r in replicas):  # hybrid: each replica's own pool
            snaps = dict(replicas[0]["prefix_cache"]["state_snapshots"])
            for key in ("slots", "used", "taken", "restored", "evictions"):
                snaps[key] = sum(r["prefix_cache"]["state_snapshots"].get(key, 0) for r in replicas)
            pc["state_snapshots"] = snaps
        s["prefix_cache"] = pc
    if all("speculation" in r for r in replicas):  # each replica picks its own K (adaptive): steps per K added up
        sp = dict(replicas[0]["speculation"])
        hist = sum((Counter(r["speculation"]["histogram"]) for r in replicas), Counter())
        sp["histogram"] = dict(sorted(hist.items()))
        for key in ("catch_up_tokens", "probes"):
            sp[key] = sum(r["speculation"].get(key, 0) for r in replicas)
        s["speculation"] = sp
    s["acceptance_rate"] = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
    s["mean_accepted_length"] = 1 + s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
    s["tokens_per_second"] = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
    s["per_replica"] = replicas
    return s
