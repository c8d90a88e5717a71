"""Attention implementations and what each supports: devices and how far it can sit inside CUDA graphs.

The compiler and runtime ask here before capturing; asking an implementation for more than it declares
is an error that names the implementation, what was asked, and what it supports.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch


class GraphSupport(enum.IntEnum):
    """How much of a CUDA graph an attention implementation can live inside (ordered)."""

    NEVER = 0  # runs eagerly between graph pieces only (PIECEWISE)
    UNIFORM_SINGLE_TOKEN = 1  # FULL graphs for uniform 1-token decode batches
    UNIFORM_BATCH = 2  # FULL graphs for any uniform query length (decode, verify)
    ALWAYS = 3  # FULL graphs for any batch, mixed included


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    graph_support: GraphSupport
    devices: tuple[str, ...]
    why: str


BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend(
        name="reference",
        graph_support=GraphSupport.NEVER,
        devices=("cpu", "cuda"),
        why="it reads the longest sequence length back to the host, which a graph capture forbids",
    ),
    "sdpa": AttentionBackend(
        name="sdpa",
        graph_support=GraphSupport.NEVER,
        devices=("cpu", "cuda"),
        why="it reads the batch layout back to the host to attend request by request, which a graph capture forbids",
    ),
    "triton": AttentionBackend(
        name="triton",
        graph_support=GraphSupport.ALWAYS,
        devices=("cuda",),
        why="its launch grid depends only on the token count and it never syncs with the host",
    ),
}


# Op families whose implementations differ from the attention table, per name: what each name runs for that
# family, on which devices, and how far inside CUDA graphs. A family not listed follows the attention table.
# - sparse_mla (sparse MLA and its indexer, ops/sparse_mla/): "triton" runs the Triton kernels, the other
#   names the PyTorch reference (no SDPA form). Neither reads anything back to the host (shapes from T, topk,
#   the block-table width and the SM count), so both sit inside FULL graphs of any batch, mixed ones included.
# - linear_attention (Gated DeltaNet, ops/linear_attention/), by the path each batch takes: "reference" is
#   plain tensor code (a padded [requests, tokens] layout for prefill heads) whose loop bounds come from
#   shapes; "triton" runs decode / verify / draft runs (and every run while a graph is being captured) in
#   Triton kernels whose grids come from the token and request counts and the head layout, with no host read.
#   Outside captures, a batch whose shapes allow a run of CHUNK_MIN_RUN tokens (prefill chunks: PIECEWISE /
#   NONE / mixed batches, between graph pieces) reads its run lengths back once per forward and sends long
#   runs' heads to fla-core's chunked kernel where it is installed (ops/linear_attention/chunked.py).
_SPARSE_WHY = "the PyTorch reference runs for this name; it never reads back to the host"
FAMILY_BACKENDS: dict[str, dict[str, AttentionBackend]] = {
    "sparse_mla": {
        **{name: AttentionBackend(name, GraphSupport.ALWAYS, BACKENDS[name].devices, _SPARSE_WHY) for name in BACKENDS},
        "triton": AttentionBackend(
            "triton",
            GraphSupport.ALWAYS,
            ("cuda",),
            "its launch grids depend only on the token count, topk, the block-table width and the SM count, and it "
            "never syncs with the host",
        ),
    },
    "linear_attention": {
        "reference": AttentionBackend(
            "reference",
            GraphSupport.ALWAYS,
            ("cpu", "cuda"),
            "every loop bound comes from tensor shapes and it never reads a value back to the host",
        ),
        "triton": AttentionBackend(
            "triton",
            GraphSupport.ALWAYS,
            ("cuda",),
            "inside a capture every run takes the Triton kernels (grids from token / request counts, no host "
            "read); only long runs outside captures (between graph pieces) read their lengths back for fla",
        ),
    },
}


def family_backend(family: str, name: str) -> AttentionBackend:
    """What implementation `name` supports for op family `family` (the attention table for other families)."""
    table = FAMILY_BACKENDS.get(family)
    if table is None:
        return get_backend(name)
    if name not in table:
        raise ValueError(
            f"{family.replace('_', ' ')} implementation {name!r} is unknown; choose one of {sorted(table)}"
        )
    return table[name]


def check_family_device(family: str, name: str, device_type: str) -> None:
    """Refuse `name` of `family` on a device it does not run on (the Triton interpreter runs it on the CPU)."""
    backend = family_backend(family, name)
    if device_type in backend.devices or (name == "triton" and device_type == "cpu" and triton_interpreting()):
        return
    raise ValueError(
        f"{family.replace('_', ' ')} implementation {name!r} runs on {list(backend.devices)}, not {device_type!r}; "
        "use 'reference' there (or set TRITON_INTERPRET=1 to interpret the Triton kernels on the CPU)"
    )


def linear_attention_impl(attention: str) -> str:
    """The Gated DeltaNet implementation an attention setting picks: the Triton kernels for "triton" (CUDA,
    or the interpreter), the reference for "sdpa" and "reference"."""
    get_backend(attention)
    return "triton" if attention == "triton" else "reference"


def check_linear_attention(name: str, device_type: str) -> None:
    check_family_device("linear_attention", name, device_type)


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(
            f"attention implementation {name!r} is unknown; choose one of {sorted(BACKENDS)} "
            "(CompileConfig.attention / --attention)."
        )
    return BACKENDS[name]


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached: no driver query per call), for the kernels' launch
    rules; None elsewhere, where the rules pick their smallest grids (the interpreter checks correctness only)."""
    if device.type != "cuda":
        return None
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: Triton's own setting (`triton.knobs`, Triton >= 3.4, which
    reads TRITON_INTERPRET), False where Triton is absent."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def triton_dot_settings(dtype) -> tuple[bool, str]:
    """(DOT_F32, PRECISION) for a Triton kernel whose tl.dot operands have `dtype`: the interpreter (CI) gets
    bf16 / fp16 dots wrong (triton 3.9: a 16x16 bf16 product off by 1e10), so there the operands are upcast
    (DOT_F32) and dotted in IEEE float32; on a GPU float32 dots are IEEE too, half-precision ones run on
    tensor cores ("tf32" leaves them as they are)."""
    dot_f32 = triton_interpreting() and dtype != torch.float32
    return dot_f32, "ieee" if dtype == torch.float32 or dot_f32 else "tf32"


def check_device(name: str, device_type: str) -> None:
    backend = get_backend(name)
    if device_type in backend.devices:
        return
    if name == "triton" and device_type == "cpu" and triton_interpreting():
        return  # the Triton interpreter runs kernels on CPU tensors (used by CI)
    raise ValueError(
        f"attention implementation {name!r} does not run on {device_type!r} (it runs on "
        f"{list(backend.devices)}); use 'sdpa' or 'reference' on the CPU, or set TRITON_INTERPRET=1 to interpret "
        "the Triton kernels."
    )


def default_backend(device_type: str) -> str:
    """Triton on CUDA; on the CPU, SDPA per request (the reference is the oracle, 40-100x slower on long prompts)."""
    return "triton" if device_type == "cuda" else "sdpa"


def require_graph_support(name: str, needed: GraphSupport, what: str) -> None:
    backend = get_backend(name)
    if backend.graph_support < needed:
        raise ValueError(
            f"attention implementation {name!r} supports CUDA graphs up to {backend.graph_support.name}, "
            f"but {what} needs {needed.name}: {backend.why}. Use attention='triton' or a PIECEWISE mode."
        )
