"""The debugging environment variables, all in one place; each has a CLI flag twin.

DRAFTGRAPH_CHECK_ADDRESSES=1   --check-addresses   verify static input addresses at every graph replay
DRAFTGRAPH_DUMP_GRAPHS=DIR     --dump-graphs DIR   write each pass's before/after graph to DIR
DRAFTGRAPH_KERNELS_AHEAD=0     (no flag)           our Triton kernels compile at their first launch, not ahead
                                                   in threads (compiler/pool/kernels_ahead.py): for comparisons
DRAFTGRAPH_KV_VMM=0            (no flag)           a KV cache sized from measured memory is allocated twice and
                                                   every graph captured twice, instead of growing in place under
                                                   the probe's graphs (runtime/growable.py): for comparisons
DRAFTGRAPH_TORCH_CUSTOM_OP=1   (no flag)           draftgraph's ops are defined through torch.library.custom_op
                                                   (Python autograd layers around every eager call), not straight
                                                   into the dispatcher (ops/registry.py): for comparisons
DRAFTGRAPH_UNFUSE_ADDMM=0      (no flag)           Inductor fuses residual adds into cuBLAS addmm (a copy of the
                                                   residual first) instead of keeping mm + add
                                                   (passes/unfuse_addmm.py): for comparisons
DRAFTGRAPH_RACE_KERNEL=0       (no flag)           eager token draws on CUDA run torch ops over [N, V] noise
                                                   instead of the Triton exponential race
                                                   (ops/sampling/triton_race.py): for comparisons
DRAFTGRAPH_NORM_KERNEL=0       (no flag)           RMSNorm and the decoder layer's residual add run as torch ops
                                                   (Inductor's kernels when compiled) instead of
                                                   draftgraph::rms_norm / add_rms_norm (ops/norm: one Triton
                                                   kernel each on CUDA): for comparisons
DRAFTGRAPH_GEMV_KERNEL=0       (no flag)           the models' linear layers on CUDA run F.linear (cuBLAS) at every
                                                   row count instead of draftgraph::linear (ops/linear: a Triton
                                                   GEMV for a few rows): for comparisons
DRAFTGRAPH_ROPE_KERNEL=0       (no flag)           the Llama attention's RoPE on q and k and the copy of v on CUDA
                                                   run as torch ops (Inductor's kernels when compiled) instead of
                                                   draftgraph::rope_qkv (ops/rope: one Triton kernel): for
                                                   comparisons
DRAFTGRAPH_NORM_LINEAR=0       (no flag)           a Llama layer's pre-norms and the projections after them (qkv,
                                                   gate_up) on CUDA run as the norm op then the linear op, instead
                                                   of one draftgraph::add_rms_norm_linear each (the norm made
                                                   inside the one-row GEMV): for comparisons
DRAFTGRAPH_ROPE_KV_WRITE=0     (no flag)           k and v go into the paged caches through the attention op's
                                                   own write kernel, instead of the fused RoPE kernel writing them
                                                   (draftgraph::rope_qkv_write, with the Triton attention on
                                                   CUDA): for comparisons
DRAFTGRAPH_PRESTART_WORKERS=0  (no flag)           the `draftgraph` command starts its compile workers when the
                                                   engine build begins, not before it imports torch (cli.py)
"""

from __future__ import annotations

import os


def check_addresses() -> bool:
    return os.environ.get("DRAFTGRAPH_CHECK_ADDRESSES", "0") == "1"


def dump_graphs_dir() -> str:
    return os.environ.get("DRAFTGRAPH_DUMP_GRAPHS", "")


def kernels_ahead() -> bool:
    return os.environ.get("DRAFTGRAPH_KERNELS_AHEAD", "1") != "0"


def prestart_workers() -> bool:
    return os.environ.get("DRAFTGRAPH_PRESTART_WORKERS", "1") != "0"


def kv_vmm() -> bool:
    return os.environ.get("DRAFTGRAPH_KV_VMM", "1") != "0"


def torch_custom_op() -> bool:
    return os.environ.get("DRAFTGRAPH_TORCH_CUSTOM_OP", "0") == "1"


def unfuse_addmm() -> bool:
    return os.environ.get("DRAFTGRAPH_UNFUSE_ADDMM", "1") != "0"


def race_kernel() -> bool:
    return os.environ.get("DRAFTGRAPH_RACE_KERNEL", "1") != "0"


def norm_kernel() -> bool:
    return os.environ.get("DRAFTGRAPH_NORM_KERNEL", "1") != "0"


def gemv_kernel() -> bool:
    return os.environ.get("DRAFTGRAPH_GEMV_KERNEL", "1") != "0"


def rope_kernel() -> bool:
    return os.environ.get("DRAFTGRAPH_ROPE_KERNEL", "1") != "0"


def norm_linear_kernel() -> bool:
    return os.environ.get("DRAFTGRAPH_NORM_LINEAR", "1") != "0"


def rope_kv_write() -> bool:
    return os.environ.get("DRAFTGRAPH_ROPE_KV_WRITE", "1") != "0"
