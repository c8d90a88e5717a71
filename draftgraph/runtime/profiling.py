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
    kernel_us: Counter = field(default_factory=Counter)  # GPU time per kernel name, in graphs or not
    kernel_calls: Counter = field(default_factory=Counter)
    span_us: float = 0.0  # first kernel start to last kernel end

    def format_time(self, top: int = 15) -> str:
        """Where the GPU time goes per step: busy vs the span of kernels, top kernels by time."""
        steps = max(self.steps, 1)
        busy = sum(self.kernel_us.values())
        lines = [
            f"GPU kernel time {busy / steps:.1f} us/step over a span of {self.span_us / steps:.1f} us/step "
            f"({100.0 * busy / max(self.span_us, 1e-9):.0f}% busy), {sum(self.kernel_calls.values()) / steps:.0f} "
            "kernels/step"
        ]
        for name, us in self.kernel_us.most_common(top):
            n = self.kernel_calls[name]
            lines.append(f"  {us / steps:8.1f} us/step  {n / steps:5.0f} calls  {us / n:7.2f} us/call  {name[:90]}")
        return "\n".join(lines)

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
    first, last = float("inf"), 0.0
    for e in events:
        if e.get("cat") != "kernel":
            continue
        name, ts, dur = e.get("name", "?"), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        out.kernel_us[name] += dur
        out.kernel_calls[name] += 1
        first, last = min(first, ts), max(last, ts + dur)
        if launcher.get(e.get("args", {}).get("correlation"), "").startswith(_GRAPH_LAUNCH):
            out.in_graphs += 1
        else:
            out.outside += 1
            out.outside_by_name[name] += 1
    out.span_us = max(last - first, 0.0)
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
