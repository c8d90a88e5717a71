"""CompileConfig (what a user sets) and ResolvedConfig (every "auto" made concrete, in one place)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from draftgraph.models.attention.backends import (
    GraphSupport,
    check_device,
    default_backend,
    get_backend,
    require_graph_support,
)

log = logging.getLogger("draftgraph")


class CUDAGraphMode(str, enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"


FULL_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
PIECEWISE_MODES = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
# Modes this build implements; the others are listed in CUDAGraphMode and refused with a message.
AVAILABLE_MODES = tuple(CUDAGraphMode)
_said = {"graphs_off": False}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CompileConfig:
    """How to compile and run a model pair. "auto" fields are resolved by `resolve()`."""

    mode: str = "NONE"
    num_speculative_tokens: int = 3
    attention: str = "auto"  # "sdpa" | "reference" | "triton" | "auto" (triton on CUDA, sdpa on CPU)
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto" (the checkpoint's, else float32)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 0  # 0 = auto: the target's max_position_embeddings, capped at 4096
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = auto: room for max_num_seqs requests of max_model_len (or see below)
    # CUDA: the fraction of device memory the engine may hold; the KV cache gets what weights, activations
    # and CUDA graphs leave, measured before it is allocated (compiler/memory.py). 0 = off.
    gpu_memory_utilization: float = 0.0
    drafter_kind: str | None = None  # None = detect from the drafter's checkpoint
    seed: int = 0  # seeds requests that give none
    # Compilation (modes other than NONE)
    capture_sizes: tuple[int, ...] = ()  # token counts with compiled pieces and graphs; () = auto
    max_capture_tokens: int = 0  # PIECEWISE bound on padded token counts; 0 = auto
    max_capture_reqs: int = 0  # FULL bound on padded request counts; 0 = auto (max_num_seqs)
    full_capture_sizes: tuple[int, ...] = ()  # request counts with FULL graphs; () = auto
    compile_backend: str = "inductor"  # "inductor", or "eager" (split pieces run as plain FX, for debugging)
    cache_dir: str = ""  # Inductor cache directory for this model's pieces; "" = Inductor's default
    use_cuda_graphs: bool = True  # False: compiled pieces without graphs even on CUDA (for comparison)
    # When CUDA graphs are captured: "eager" = every capture size before the engine is returned (largest
    # first, one pool, predictable memory); "lazy" = each graph at the first step that needs it (fast start;
    # that step pays the capture, and graph memory grows with the sizes actually used).
    capture: str = "eager"
    fuse_draft_loop: bool = True  # FULL modes: the drafter's K steps as one graph (False: a graph per step)
    check_addresses: bool = False  # debug: verify static input addresses at every graph replay
    dump_graphs_dir: str = ""  # write each pass's before/after graph here
    progress: bool = True  # progress bars for compile and capture

    def __post_init__(self):
        modes = [m.value for m in CUDAGraphMode]
        if self.mode not in modes:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {modes}")
        if self.mode not in [m.value for m in AVAILABLE_MODES]:
            raise ValueError(
                f"mode={self.mode!r} is not available in this build yet; available: "
                f"{[m.value for m in AVAILABLE_MODES]}"
            )
        if not 0 <= self.num_speculative_tokens <= 8:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must lie in [0, 8]")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; choose one of {['auto', *DTYPES]}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is unknown; choose 'auto', 'cpu' or 'cuda'")
        if self.attention != "auto":
            get_backend(self.attention)
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1), e.g. 0.9; 0 turns it off"
            )
        if self.gpu_memory_utilization and self.num_kv_blocks:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} and gpu_memory_utilization={self.gpu_memory_utilization} both "
                "size the KV cache; set one of them"
            )
        if self.capture not in ("eager", "lazy"):
            raise ValueError(
                f"capture={self.capture!r} is unknown; choose 'eager' (capture every size at start) or 'lazy' "
                "(capture each size when a step first needs it)"
            )
        if self.compile_backend not in ("inductor", "eager"):
            raise ValueError(f"compile_backend={self.compile_backend!r} is unknown; choose 'inductor' or 'eager'")
        if any(s < 1 for s in self.capture_sizes):
            raise ValueError(f"capture_sizes={self.capture_sizes} must all be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        needed = self.max_num_seqs * (self.num_speculative_tokens + 1)
        if self.max_num_batched_tokens < needed:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold a full decode batch: "
                f"max_num_seqs x (1 + K) = {needed}; raise it to at least {needed}"
            )


@dataclass(frozen=True)
class ResolvedConfig:
    """CompileConfig with every "auto" decided."""

    mode: CUDAGraphMode
    num_speculative_tokens: int  # 0 without a drafter
    attention: str
    device: torch.device
    dtype: torch.dtype | None  # None: keep the checkpoint's dtype
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    seed: int
    capture_sizes: tuple[int, ...]  # token counts with compiled pieces (PIECEWISE graphs); empty in NONE
    full_capture_sizes: tuple[int, ...]  # request counts with FULL graphs; empty without a FULL mode
    graphs_enabled: bool  # CUDA graphs are captured (a graph mode on a CUDA device)
    fuse_draft_loop: bool = False  # a FULL mode with a drafter and fusing on
    lazy_capture: bool = False  # graphs are captured when a step first needs them (capture="lazy")

    @property
    def lookahead(self) -> int:
        """KV positions past a request's tokens that one speculative step may write."""
        return 2 * self.num_speculative_tokens + 2

    @property
    def max_blocks_per_req(self) -> int:
        return -(-(self.max_model_len + self.lookahead) // self.block_size)


def resolve(config: CompileConfig, target_max_positions: int | None, has_drafter: bool) -> ResolvedConfig:
    """Decide every "auto" value once and log each decision."""
    device = torch.device(
        "cuda"
        if config.device == "auto" and torch.cuda.is_available()
        else ("cpu" if config.device == "auto" else config.device)
    )
    attention = default_backend(device.type) if config.attention == "auto" else config.attention
    if config.gpu_memory_utilization and device.type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} sizes the KV cache from CUDA memory, but the "
            f"device is {device.type}; set num_kv_blocks (or leave both at 0 for room for max_num_seqs requests)"
        )
    check_device(attention, device.type)
    max_len = config.max_model_len or min(target_max_positions or 4096, 4096)
    k = config.num_speculative_tokens if has_drafter else 0
    lookahead = 2 * k + 2
    blocks = config.num_kv_blocks or config.max_num_seqs * -(-(max_len + lookahead) // config.block_size)
    mode = CUDAGraphMode(config.mode)
    # A draft model's first step runs one extra row per request beyond the target's tokens.
    max_capture = config.max_capture_tokens or min(config.max_num_batched_tokens + config.max_num_seqs, 512)
    if mode == CUDAGraphMode.NONE:
        sizes = ()
    elif config.capture_sizes:
        sizes = tuple(sorted(set(config.capture_sizes)))
    else:
        sizes = auto_capture_sizes(max_capture, device.type)
    graphs = mode != CUDAGraphMode.NONE and device.type == "cuda" and config.use_cuda_graphs
    full = mode in FULL_MODES
    full_sizes = ()
    if full:
        bound = config.max_capture_reqs or config.max_num_seqs
        full_sizes = tuple(sorted(set(config.full_capture_sizes))) or tuple(
            sorted({s for s in (1, 2, 4) if s <= bound} | set(range(8, bound + 1, 8)) | {bound})
        )
        # Every FULL graph runs the compiled pieces at its token count: compile those sizes too.
        qs = {1, k + 1, k + 2} if k else {1}
        sizes = tuple(sorted(set(sizes) | {b * q for b in full_sizes for q in qs}))
        if graphs:
            need = GraphSupport.UNIFORM_BATCH if k else GraphSupport.UNIFORM_SINGLE_TOKEN
            require_graph_support(attention, need, f"mode {mode.value} (full graphs of uniform batches)")
    if mode != CUDAGraphMode.NONE and device.type != "cuda" and not _said["graphs_off"]:
        _said["graphs_off"] = True  # said once per process
        log.warning(
            "CUDA graphs are disabled on %s: mode %s runs its compiled pieces without graphs", device.type, mode.value
        )
    rc = ResolvedConfig(
        mode=CUDAGraphMode(config.mode),
        num_speculative_tokens=k,
        attention=attention,
        device=device,
        dtype=None if config.dtype == "auto" else DTYPES[config.dtype],
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
        block_size=config.block_size,
        num_kv_blocks=blocks,
        seed=config.seed,
        capture_sizes=sizes,
        full_capture_sizes=full_sizes,
        graphs_enabled=graphs,
        fuse_draft_loop=full and k > 0 and config.fuse_draft_loop,
        lazy_capture=graphs and config.capture == "lazy",
    )
    log.info(
        "draftgraph config: mode %s on %s, attention %s, K=%d, up to %d requests / %d tokens per step, "
        "max_model_len %d, %d KV blocks of %d; capture sizes %s (CUDA graphs %s)",
        rc.mode.value,
        device,
        attention,
        k,
        rc.max_num_seqs,
        rc.max_num_batched_tokens,
        max_len,
        blocks,
        rc.block_size,
        list(sizes) or "none",
        "on" if graphs else "off",
    )
    return rc


def auto_capture_sizes(max_tokens: int, device_type: str) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16 up to max_tokens on CUDA; powers of two up to 64 on the CPU (each size
    there costs an Inductor compile and buys no graph)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_tokens]
    if device_type == "cuda":
        sizes += list(range(16, max_tokens + 1, 16))
    else:
        s = 16
        while s <= min(max_tokens, 64):
            sizes.append(s)
            s *= 2
    if device_type == "cuda" and max_tokens not in sizes:
        sizes.append(max_tokens)
    return tuple(sorted(set(sizes)))
