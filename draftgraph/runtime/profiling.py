"""Proof of what ran: a profiler pass over engine steps that counts GPU kernels launched from CUDA graph
replays against kernels launched one by one from Python.

The profiler's trace links every kernel to the runtime call that launched it (its correlation id):
`cudaGraphLaunch` for a replay, `cudaLaunchKernel` (or a driver launch) otherwise. A healthy FULL step
launches almost every kernel from graphs; what remains outside is the step's host-side glue (the
rejection sampler, input copies), listed by name so it can be acted on.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class KernelSummary:
    steps: int
    graph_launches: int = 0  # cudaGraphLaunch calls (one per replayed graph)
    in_graphs: int = 0  # kernels those replays ran
    outside: int = 0  # kernels launched directly
    outside_by_name: Counter = field(default_factory=Counter)
    cuda: bool = True

    def format(self, top: int = 8) -> str:
        if not self.cuda:
            return f"profiled {self.steps} steps on the CPU: no GPU kernels (CUDA graphs need a CUDA device)"
        total = self.in_graphs + self.outside
        share = 100.0 * self.in_graphs / total if total else 0.0
        lines = [
            f"profiled {self.steps} steps: {total} GPU kernels, {self.in_graphs} ({share:.1f}%) from "
            f"{self.graph_launches} CUDA graph replays, {self.outside} launched outside graphs"
            f" ({self.outside / max(self.steps, 1):.1f} per step)"
        ]
        for name, n in self.outside_by_name.most_common(top):
            lines.append(f"  outside graphs: {n:6d}  {name[:100]}")
        return "\n".join(lines)


_GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


def summarize_trace(events: list[dict], steps: int) -> KernelSummary:
    """Count kernels by how they were launched, from a Chrome-trace event list (torch.profiler export)."""
    launcher = {}
    out = KernelSummary(steps)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launcher[corr] = e.get("name", "")
            if e.get("name", "").startswith(_GRAPH_LAUNCH):
                out.graph_launches += 1
    for e in events:
        if e.get("cat") != "kernel":
            continue
        if launcher.get(e.get("args", {}).get("correlation"), "").startswith(_GRAPH_LAUNCH):
            out.in_graphs += 1
        else:
            out.outside += 1
            out.outside_by_name[e.get("name", "?")] += 1
    return out


def profile_steps(engine, steps: int) -> KernelSummary:
    """Run up to `steps` engine steps (requests must be queued) under the profiler and summarize."""
    cuda = engine.config.device.type == "cuda"
    if not cuda:
        n = 0
        while n < steps and engine.has_unfinished():
            engine.step()
            n += 1
        return KernelSummary(n, cuda=False)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    n = 0
    with torch.profiler.profile(activities=acts) as prof:
        while n < steps and engine.has_unfinished():
            engine.step()
            n += 1
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return summarize_trace(events, n)
