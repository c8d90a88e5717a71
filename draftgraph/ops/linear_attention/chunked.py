"""Long runs on CUDA: fla-core's chunked gated delta rule for their heads, outside CUDA graph captures.

A run of n >= `CHUNK_MIN_RUN` tokens (a prefill chunk) is split as the reference splits it: its head (the
first n - L tokens) goes through fla's `chunk_gated_delta_rule` (varlen: cu_seqlens, and its host copy so
fla reads nothing back; q, k l2-normalised in its kernel; initial state from the ring entry before the run,
zeros at position 0) and the head's final state is written to the ring entry of its last position; the
recurrent kernel then runs the tail (the last L tokens) from there (`skip`), writing the outputs, the
per-position states the ring keeps and the conv ring, exactly as for a short run.

Choosing this needs each run's length on the host: ONE read of query_start_loc and token_kv_len per forward
(the plan is reused by every layer while those tensors are unchanged), taken only when
- fla imports (lazily: fla-core is an optional CUDA dependency) and the head dims suit its kernels;
- the stream is not capturing a CUDA graph (a capture never reads the host: every run takes the kernel);
- the shapes allow a long run: T - B + 1 >= CHUNK_MIN_RUN (decode batches never read; uniform verify
  batches only from T - B + 1 = B K + 1 >= 128, i.e. B >= 43 at K = 3, and those run in FULL graphs).
So the read happens between graph pieces (PIECEWISE, NONE, mixed batches), never inside a graph.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch

# Shortest run whose head goes to fla. Measured on an H100, one ~1B-shaped layer, eager (scripts/bench_qwen3_5.py,
# docs/history/benchmarks-2026-11.md, 2026-11-23): our kernel 196 / 755 / 3483 us at 128 / 512 / 2048 tokens,
# fla 2953 / 2143 / 2053.
CHUNK_MIN_RUN = 1536


@functools.cache
def fla_chunk_fn():
    """fla's `chunk_gated_delta_rule`, or None where fla-core is not installed (imported at the first call)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_suits(head_k_dim: int, head_v_dim: int) -> bool:
    """fla's chunk kernels tile K and V by 16 or more and hold K <= 256."""
    return head_k_dim % 16 == 0 and head_v_dim % 16 == 0 and 16 <= head_k_dim <= 256


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class ChunkPlan:
    """The long runs of one forward (device tensors unless named _cpu)."""

    tokens: torch.Tensor  # [Th] int64: the heads' token rows, run after run
    cu_seqlens: torch.Tensor  # [N + 1] int64: head boundaries in `tokens`
    cu_seqlens_cpu: torch.Tensor  # the same on the host (fla then reads nothing back)
    reqs: torch.Tensor  # [N] int64: the requests with a head
    first_entry: torch.Tensor  # [N] int64: ring entry of the state before the run, (p0 - 1) % L
    has_state: torch.Tensor  # [N] bool: p0 > 0 (else the run starts from zeros)
    last_entry: torch.Tensor  # [N] int64: ring entry of the head's last position
    skip: torch.Tensor  # [B] int32: head tokens per request (0: the kernel runs the whole run)


def plan_chunks(query_start_loc, token_kv_len, ring: int, min_run: int) -> ChunkPlan | None:
    """One host read; None when no run is long. A run's valid tokens come first in its rows (op.py)."""
    b = query_start_loc.shape[0] - 1
    host = torch.cat([query_start_loc.long(), token_kv_len.long()]).cpu().numpy()
    qsl, kv = host[: b + 1], host[b + 1 :]
    valid_before = np.concatenate([[0], np.cumsum(kv > 0)])
    n = valid_before[qsl[1:]] - valid_before[qsl[:-1]]
    long = np.flatnonzero(n >= max(min_run, ring + 1))
    if long.size == 0:
        return None
    starts, head = qsl[long], n[long] - ring
    p0 = kv[starts] - 1
    cu = np.concatenate([[0], np.cumsum(head)])
    tokens = np.repeat(starts - cu[:-1], head) + np.arange(cu[-1])
    skip = np.zeros(b, dtype=np.int64)
    skip[long] = head
    parts = (tokens, cu, long, (p0 - 1) % ring, p0 > 0, (p0 + head - 1) % ring, skip)
    dev = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(query_start_loc.device, non_blocking=True)
    v = dev.split([len(p) for p in parts])
    return ChunkPlan(v[0], v[1], torch.from_numpy(cu), v[2], v[3], v[4].bool(), v[5], v[6].int())


class _LastPlan:
    """The last plan and what it was made from: every layer of a forward gets the same metadata tensors, so
    the first layer reads the host and the others reuse its plan. A hit needs the very same tensor objects
    (weak references) at the same versions (in-place writes bump them) with the same settings."""

    def __init__(self):
        self.refs, self.versions, self.settings, self.plan = (), (), None, None

    def get_or_make(self, tensors, settings, make):
        if (
            self.refs
            and settings == self.settings
            and all(r() is t for r, t in zip(self.refs, tensors))
            and self.versions == tuple(t._version for t in tensors)
        ):
            return self.plan
        plan = make()
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.versions = tuple(t._version for t in tensors)
        self.settings, self.plan = settings, plan
        return plan


_LAST = _LastPlan()


def maybe_plan(query_start_loc, token_kv_len, num_tokens: int, ring: int, min_run: int) -> ChunkPlan | None:
    """The plan where the shapes allow a long run and no graph is being captured; else None, with no read."""
    b = query_start_loc.shape[0] - 1
    if num_tokens - b + 1 < min_run or capturing(query_start_loc.device):
        return None
    tensors = (query_start_loc, token_kv_len)
    return _LAST.get_or_make(
        tensors, (num_tokens, ring, min_run), lambda: plan_chunks(query_start_loc, token_kv_len, ring, min_run)
    )


def run_heads(plan: ChunkPlan, chunk_fn, conv, g, beta, ssm_states, rows, out, num_k_heads: int) -> None:
    """The long runs' heads through `chunk_fn` (fla's signature): outputs into `out`, final states into
    the ring entries the recurrent kernel then starts those runs from."""
    _, _, hv, dk, dv = ssm_states.shape
    c = conv[plan.tokens]  # [Th, C]
    th, qk = c.shape[0], num_k_heads * dk
    q, k, v = c[:, :qk].view(1, th, num_k_heads, dk), c[:, qk : 2 * qk].view(1, th, num_k_heads, dk), c[:, 2 * qk :]
    rows = rows.long()[plan.reqs]
    h0 = torch.where(plan.has_state[:, None, None, None], ssm_states[rows, plan.first_entry], 0.0)
    o, final = chunk_fn(
        q, k, v.reshape(1, th, hv, dv), g[plan.tokens][None], beta[plan.tokens][None], scale=dk**-0.5,
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=plan.cu_seqlens,
        cu_seqlens_cpu=plan.cu_seqlens_cpu,
    )  # fmt: skip
    out[plan.tokens] = o[0].to(out.dtype)
    ssm_states[rows, plan.last_entry] = final.float()
