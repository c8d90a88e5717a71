"""CompileConfig (what a user sets) and ResolvedConfig (every "auto" made concrete, in one place).

Over 500 lines on purpose: the user's fields, their checks and `resolve()` stay side by side, so that a new option's
meaning, its error message and how "auto" resolves are read and changed together (the project's one place where
configuration is resolved)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from draftgraph.compiler.inductor_options import resolve_inductor_options
from draftgraph.ops.backends import (
    GraphSupport,
    check_device,
    default_backend,
    get_backend,
    require_graph_support,
)
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices

log = logging.getLogger("draftgraph")


class CUDAGraphMode(str, enum.Enum):
    """NONE: eager. PIECEWISE: piece graphs by padded token count for every batch. FULL: whole-forward graphs
    for uniform batches (every request with the same query length: verify, decode, the draft steps),
    compiled code without graphs for the rest. FULL_AND_PIECEWISE: FULL where it applies, else PIECEWISE."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"


FULL_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)
PIECEWISE_MODES = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
# Modes this build implements; the others are listed in CUDAGraphMode and refused with a message.
AVAILABLE_MODES = tuple(CUDAGraphMode)
# Modes other engines have that draftgraph folds into one of its own: name -> (ours, why).
FOLDED_MODES = {
    "FULL_DECODE_ONLY": (
        "FULL",
        "FULL already captures whole-forward graphs only for uniform (decode / verify) batches and runs mixed "
        "batches without graphs",
    )
}
_said = {"graphs_off": False}
SPECULATION = ("auto", "fixed", "adaptive")  # CompileConfig.speculation
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALL_REDUCE_CHOICES = ("auto", "nccl")


@dataclass(frozen=True)
class CompileConfig:
    """How to compile and run a model pair. "auto" fields are resolved by `resolve()`."""

    # "auto": FULL_AND_PIECEWISE on CUDA, NONE on the CPU (where no graph can be captured), or the mode an
    # artifact directory was built for; or one of CUDAGraphMode's names.
    mode: str = "auto"
    num_speculative_tokens: int = 3  # K; checked (0..8) only when there is a drafter
    attention: str = "auto"  # "sdpa" | "reference" | "triton" | "auto" (triton on CUDA, sdpa on CPU)
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto" (the checkpoint's, else float32)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 0  # 0 = auto: the target's max_position_embeddings, capped at 4096
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = auto: room for max_num_seqs requests of max_model_len (or see below)
    # CUDA: the fraction of device memory the engine may hold; the KV cache gets what weights, activations
    # and CUDA graphs leave, measured before it is allocated (runtime/memory.py). 0 = off.
    # None = auto: 0.9 on CUDA unless num_kv_blocks is set, off on the CPU.
    gpu_memory_utilization: float | None = None
    drafter_kind: str | None = None  # None = detect from the drafter's checkpoint
    # drafter="ngram" (prompt lookup, models/drafters/ngram.py): the n-gram lengths matched, longest first.
    ngram_min: int = 1
    ngram_max: int = 3
    seed: int = 0  # seeds requests that give none
    # Ranks the target is split over (> 1: compile_model starts one worker process per device, workers/).
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None  # the target's, or 1 (replicated); None = the target's
    # Engine replicas, each with its own scheduler and requests, spread by the engine (> 1: worker processes;
    # world = data_parallel_size x tensor_parallel_size ranks).
    data_parallel_size: int = 1
    # Split a MoE target's experts whole across all tensor_parallel_size x data_parallel_size ranks (the EP group;
    # with several replicas they then step together); the router stays replicated, the drafter, attention and
    # the shared experts as without it. Needs tp x dp >= 2 (models/parallel/experts.py).
    expert_parallel: bool = False
    # How tensor-parallel all-reduces run on CUDA: "auto" = small messages over peer memory (our lamport /
    # push kernels, torch's one-shot / two-shot, by the measured rule in ops/collectives/peer.py) where every rank of
    # the group reaches its peers' memory, NCCL for the rest and elsewhere; "nccl" = NCCL for every all-reduce.
    all_reduce: str = "auto"
    # Compilation (modes other than NONE)
    capture_sizes: tuple[int, ...] = ()  # PIECEWISE: padded token counts with piece graphs; () = auto
    # Token counts that get an Inductor compile of their own (specialised to the size) beside the one
    # symbolic-size compile every piece has; graphs at these sizes are captured from it. () = none.
    compile_sizes: tuple[int, ...] = ()
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
    # FULL modes: the drafter's K steps as one Dynamo trace per variant, its token choice compiled with them
    # (False: the loop runs around the compiled drafter step: a graph per step outside the one-graph step).
    # "auto": fused only when one_graph_step is off. Inside the one-graph step the loop is in the step's graph
    # either way; fusing there costs two traces of K drafter steps (5-7 s of a cold start) and, with the
    # metadata advance as one Triton kernel, buys no step time (docs/history/benchmarks-2026-11.md, 2026-11-24).
    fuse_draft_loop: bool | str = "auto"
    # FULL modes: a uniform decode batch's whole step (verify, LM head, acceptance, the K drafts) is one graph
    # (False: a verify graph, then the acceptance outside graphs, then the draft loop's graph or graphs).
    one_graph_step: bool = True
    # With one_graph_step: in steady uniform decoding the next step is launched before the host reads the last
    # one's tokens (the step advances its own inputs on the device), so the host's work overlaps the GPU's.
    overlap_steps: bool = True
    check_addresses: bool = False  # debug: verify static input addresses at every graph replay
    dump_graphs_dir: str = ""  # write each pass's before/after graph here
    progress: bool = True  # progress bars for compile and capture
    # Inductor settings for every piece: None = draftgraph's measured defaults (compiler/inductor_options.py),
    # () = Inductor's own, or (key, value) pairs of torch._inductor.config.
    inductor_options: tuple[tuple[str, object], ...] | None = None
    # Processes that compile unique pieces in parallel while tracing goes on (compiler/pool/compile_pool.py):
    # None = auto (on CUDA half the cores, at most 8; on the CPU none), 0 = compile in this process.
    compile_workers: int | None = None
    # Which of draftgraph's kernels the models and the runtime use on CUDA (ops/choices.py: GEMV, the norm and
    # RoPE kernels, the norm inside the projection, the RoPE kernel's KV write, the race sampler, Inductor's
    # unfused residual addmm). None = every one (the measured defaults); off = the torch ops, for comparisons.
    ops: OpChoices | None = None
    # CUDA with gpu_memory_utilization: the probe's KV cache grows in place under its graphs (runtime/growable.py,
    # where the driver can), so every graph is captured once. False: the cache is allocated again at its final
    # size and every graph captured again, as on devices without virtual memory management (for comparisons).
    kv_grow_in_place: bool = True
    # Benchmarks only (no hub here, so random-weight drafters accept nothing): pinned acceptance. Conditional
    # acceptance rates per draft position, at most K of them (positions past them are rejected): draft i is
    # accepted iff every earlier one was and u_i < rate_i (counter-based noise, on the device, inside the step's
    # graphs); accepted positions emit the drafts, the bonus is the target's token. The same graphs run as with
    # real acceptance, so step times are real. Greedy requests only (a sampled one is refused); logged as a
    # WARNING and labelled in stats(). () = off: real acceptance. runtime/rejection.py: synthetic_accept.
    synthetic_acceptance: tuple[float, ...] = ()
    # Automatic prefix caching (runtime/prefix_cache.py): full KV blocks are kept after their requests end and
    # shared by later requests whose tokens start the same, which then prefill only the rest. Hybrid models (Gated
    # DeltaNet) also keep snapshots of the recurrent and conv states at block boundaries (runtime/state_snapshots.py).
    # False: every prompt is prefilled from its start.
    prefix_caching: bool = True
    # Hybrid models with prefix caching: the device slots for state snapshots (each one state per Gated DeltaNet
    # layer: runtime/state_snapshots.py gives the bytes); a prefix is a hit only up to a snapshot. 0 = auto:
    # max_num_seqs (1/L of the per-request state rings' memory, L = K + 1).
    prefix_state_snapshots: int = 0
    # With a drafter: "fixed" verifies num_speculative_tokens drafts every step; "adaptive" picks each decode step's
    # K from {0, ceil(K/2), K} (K = num_speculative_tokens, the largest) by a cost model: step time per (K, batch)
    # measured on the captured step graphs at start-up against the tokens expected from running per-position
    # acceptance rates (runtime/adaptive.py). Steps with prompt chunks run K, or 0 while the controller is there.
    # "auto": "adaptive" where its step times are measured (CUDA graphs of the one-graph step, captured at start-up)
    # and no other rank steps with this one (tensor parallelism, expert-parallel replicas); "fixed" elsewhere (the
    # CPU, mode NONE, lazy capture), logged.
    speculation: str = "auto"

    def __post_init__(self):
        check_synthetic_acceptance(self.synthetic_acceptance)
        if self.speculation not in SPECULATION:
            raise ValueError(
                f"speculation={self.speculation!r} is unknown; choose one of {list(SPECULATION)} ('fixed': K drafts "
                "every step; 'adaptive': each decode step picks K from {0, ceil(K/2), K} by measured step times and "
                "running acceptance; 'auto': adaptive where CUDA graphs time the steps, else fixed)"
            )
        check_ngram_sizes(self.ngram_min, self.ngram_max)
        if self.ops is not None and not isinstance(self.ops, OpChoices):
            raise TypeError(
                f"ops={self.ops!r} must be an OpChoices or None (every draftgraph kernel); e.g. "
                "CompileConfig(ops=OpChoices(gemv=False)), or OpChoices.parse('gemv=0,rope_kv_write=0')"
            )
        if not isinstance(self.kv_grow_in_place, bool):
            raise TypeError(f"kv_grow_in_place={self.kv_grow_in_place!r} must be True (default) or False")
        if not isinstance(self.prefix_caching, bool):
            raise TypeError(f"prefix_caching={self.prefix_caching!r} must be True (default) or False")
        if not isinstance(self.prefix_state_snapshots, int) or self.prefix_state_snapshots < 0:
            raise ValueError(
                f"prefix_state_snapshots={self.prefix_state_snapshots!r} must be an int >= 0 (0 = auto: max_num_seqs)"
            )
        modes = ["auto", *(m.value for m in CUDAGraphMode)]
        if self.mode in FOLDED_MODES:
            ours, why = FOLDED_MODES[self.mode]
            raise ValueError(f"mode={self.mode!r} is not a separate mode here: {why}; use mode={ours!r}")
        if self.mode not in modes:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {modes}")
        if self.mode != "auto" and self.mode not in [m.value for m in AVAILABLE_MODES]:
            raise ValueError(
                f"mode={self.mode!r} is not available in this build yet; available: "
                f"{['auto', *(m.value for m in AVAILABLE_MODES)]}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; choose one of {['auto', *DTYPES]}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is unknown; choose 'auto', 'cpu' or 'cuda'")
        if self.attention != "auto":
            get_backend(self.attention)
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 <= util < 1.0:
            raise ValueError(
                f"gpu_memory_utilization={util} must lie in (0, 1), e.g. 0.9; 0 turns it off, None = auto "
                "(0.9 on CUDA unless num_kv_blocks is set)"
            )
        if util and self.num_kv_blocks:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} and gpu_memory_utilization={util} both "
                "size the KV cache; set one of them"
            )
        if not (isinstance(self.fuse_draft_loop, bool) or self.fuse_draft_loop == "auto"):
            raise ValueError(f"fuse_draft_loop={self.fuse_draft_loop!r} is unknown; choose 'auto', True or False")
        if self.capture not in ("eager", "lazy"):
            raise ValueError(
                f"capture={self.capture!r} is unknown; choose 'eager' (capture every size at start) or 'lazy' "
                "(capture each size when a step first needs it)"
            )
        if self.compile_backend not in ("inductor", "eager"):
            raise ValueError(f"compile_backend={self.compile_backend!r} is unknown; choose 'inductor' or 'eager'")
        if any(s < 1 for s in self.capture_sizes):
            raise ValueError(f"capture_sizes={self.capture_sizes} must all be >= 1")
        if any(s < 1 for s in self.compile_sizes):
            raise ValueError(f"compile_sizes={self.compile_sizes} must all be >= 1")
        if self.compile_workers is not None and not 0 <= self.compile_workers <= 64:
            raise ValueError(
                f"compile_workers={self.compile_workers} must lie in 0..64 (0 = compile in this process, "
                "None = auto: half the cores on CUDA, at most 8)"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 = auto)")
        check_parallel(self.tensor_parallel_size, self.draft_tensor_parallel_size)
        check_data_parallel(self.data_parallel_size, self.tensor_parallel_size, self.expert_parallel)
        if self.all_reduce not in ALL_REDUCE_CHOICES:
            raise ValueError(
                f'all_reduce={self.all_reduce!r} is unknown; choose one of {list(ALL_REDUCE_CHOICES)} ("auto": peer '
                "memory for small messages where the GPUs reach each other, NCCL otherwise)"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (1, 2, 4, 8, 16, ...); e.g. 16")


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
    capture_sizes: tuple[int, ...]  # PIECEWISE dispatch sizes (padded token counts with piece graphs)
    full_capture_sizes: tuple[int, ...]  # request counts with FULL graphs; empty without a FULL mode
    graphs_enabled: bool  # CUDA graphs are captured (a graph mode on a CUDA device)
    fuse_draft_loop: bool = False  # a FULL mode with a drafter and fusing on
    one_graph_step: bool = False  # a FULL mode with one_graph_step on
    overlap_steps: bool = False  # one_graph_step with overlap_steps on
    lazy_capture: bool = False  # graphs are captured when a step first needs them (capture="lazy")
    compile_sizes: tuple[int, ...] = ()  # token counts with a per-size Inductor compile (opt-in)
    gpu_memory_utilization: float = 0.0  # > 0: the KV cache is sized from measured CUDA memory
    mode_reason: str = ""  # why mode "auto" became `mode` ("" when the mode was given)
    inductor_options: tuple[tuple[str, object], ...] = ()  # patched into torch._inductor.config for every compile
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1  # the target's or 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    all_reduce: str = "auto"  # "auto" (peer memory where the group allows, ops/collectives/peer.py) | "nccl"
    compile_workers: int = 0  # processes compiling pieces in parallel (0: in this process)
    ops: OpChoices = DEFAULT_OPS  # the kernels models and runtime use on CUDA (recorded in artifacts)
    kv_grow_in_place: bool = True  # a KV cache sized after capture grows under the probe's graphs where it can
    synthetic_acceptance: tuple[float, ...] = ()  # pinned conditional acceptance rates (benchmarks only); () = off
    prefix_caching: bool = True  # full KV blocks kept and shared across requests (runtime/prefix_cache.py)
    prefix_state_snapshots: int = 16  # hybrid models: device slots for state snapshots (runtime/state_snapshots.py)
    ngram: tuple[int, int] | None = None  # the n-gram drafter's (ngram_min, ngram_max); None: another or no drafter
    # speculation="adaptive": the K a decode step may run at, ascending, the largest num_speculative_tokens
    # (runtime/adaptive.py); () = fixed K
    speculation_ks: tuple[int, ...] = ()

    @property
    def lookahead(self) -> int:
        """KV positions past a request's tokens that one speculative step may write."""
        return 2 * self.num_speculative_tokens + 2

    @property
    def warmup_tokens(self) -> int:
        """The padded token count the warm-up traces at (any count compiles the same symbolic code)."""
        return max(self.capture_sizes, default=min(16, self.max_num_batched_tokens))

    @property
    def max_blocks_per_req(self) -> int:
        return -(-(self.max_model_len + self.lookahead) // self.block_size)


def _compile_workers(config: CompileConfig, mode: CUDAGraphMode, device: torch.device) -> int:
    if mode == CUDAGraphMode.NONE or config.compile_backend != "inductor":
        return 0
    if config.compile_workers is not None:
        return config.compile_workers
    from draftgraph.compiler.pool.pool_lifetime import auto_workers

    return auto_workers(device.type, config.tensor_parallel_size * config.data_parallel_size)


def resolve(
    config: CompileConfig, target_max_positions: int | None, has_drafter: bool, artifact_mode: str | None = None
) -> ResolvedConfig:
    """Decide every "auto" value once and log each decision. `artifact_mode`: the mode of the artifact
    directory the engine will load, which mode "auto" then takes."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device='cuda' was asked for, but torch.cuda.is_available() is False here (torch {torch.__version__}, "
            + (f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build")
            + "); use device='cpu' or 'auto' (--device cpu), or run on a machine with a GPU and a CUDA build of torch"
        )
    device = torch.device(
        "cuda"
        if config.device == "auto" and torch.cuda.is_available()
        else ("cpu" if config.device == "auto" else config.device)
    )
    attention = default_backend(device.type) if config.attention == "auto" else config.attention
    util = config.gpu_memory_utilization
    if util and device.type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization={util} sizes the KV cache from CUDA memory, but the "
            f"device is {device.type}; set num_kv_blocks (or leave both at 0 for room for max_num_seqs requests)"
        )
    if util is None:  # auto: measure on CUDA unless the user sized the cache
        util = 0.9 if device.type == "cuda" and not config.num_kv_blocks else 0.0
    check_device(attention, device.type)
    if target_max_positions and config.max_model_len > target_max_positions:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the target's max_position_embeddings="
            f"{target_max_positions} (its RoPE table); lower max_model_len to at most {target_max_positions}"
        )
    max_len = config.max_model_len or min(target_max_positions or 4096, 4096)
    k = config.num_speculative_tokens if has_drafter else 0
    if has_drafter:
        check_speculative(config)
    synthetic = resolve_synthetic_acceptance(config.synthetic_acceptance, k)
    lookahead = 2 * k + 2
    blocks = config.num_kv_blocks or config.max_num_seqs * -(-(max_len + lookahead) // config.block_size)
    mode, reason = (CUDAGraphMode(config.mode), "") if config.mode != "auto" else auto_mode(device, artifact_mode)
    if reason:
        log.info("mode auto -> %s: %s", mode.value, reason)
    # A draft model's first step runs one extra row per request beyond the target's tokens.
    max_capture = config.max_capture_tokens or min(config.max_num_batched_tokens + config.max_num_seqs, 512)
    if mode not in PIECEWISE_MODES:  # NONE and FULL dispatch nothing by token count
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
        if graphs:
            need = GraphSupport.UNIFORM_BATCH if k else GraphSupport.UNIFORM_SINGLE_TOKEN
            require_graph_support(attention, need, f"mode {mode.value} (full graphs of uniform batches)")
    if mode != CUDAGraphMode.NONE and device.type != "cuda" and not _said["graphs_off"]:
        _said["graphs_off"] = True  # said once per process
        log.warning(
            "CUDA graphs are disabled on %s: mode %s runs its compiled pieces without graphs", device.type, mode.value
        )
    rc = ResolvedConfig(
        mode=mode,
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
        fuse_draft_loop=full and k > 0 and config.drafter_kind != "ngram" and fuse_loop(config),  # n-gram: no loop
        one_graph_step=full and config.one_graph_step,
        overlap_steps=full and config.one_graph_step and config.overlap_steps,
        lazy_capture=graphs and config.capture == "lazy",
        compile_sizes=tuple(sorted(set(config.compile_sizes))) if mode != CUDAGraphMode.NONE else (),
        gpu_memory_utilization=util,
        mode_reason=reason,
        inductor_options=resolve_inductor_options(config.inductor_options, (config.ops or DEFAULT_OPS).unfuse_addmm),
        tensor_parallel_size=config.tensor_parallel_size,
        draft_tensor_parallel_size=config.draft_tensor_parallel_size or config.tensor_parallel_size,
        data_parallel_size=config.data_parallel_size,
        expert_parallel=config.expert_parallel,
        all_reduce=config.all_reduce,
        compile_workers=_compile_workers(config, mode, device),
        ops=config.ops or DEFAULT_OPS,
        kv_grow_in_place=config.kv_grow_in_place,
        synthetic_acceptance=synthetic,
        prefix_caching=config.prefix_caching,
        prefix_state_snapshots=config.prefix_state_snapshots or config.max_num_seqs,
        ngram=(config.ngram_min, config.ngram_max) if has_drafter and config.drafter_kind == "ngram" else None,
        speculation_ks=resolve_speculation(
            config, k, measured=graphs and full and config.one_graph_step and config.capture != "lazy"
        ),  # fmt: skip
    )
    log.info(
        "draftgraph config: mode %s on %s, attention %s, K=%d, up to %d requests / %d tokens per step, "
        "max_model_len %d, %d KV blocks of %d (prefix caching %s); piece graph sizes %s, FULL request counts %s "
        "(CUDA graphs %s)",
        rc.mode.value,
        device,
        attention,
        k,
        rc.max_num_seqs,
        rc.max_num_batched_tokens,
        max_len,
        blocks,
        rc.block_size,
        "on" if rc.prefix_caching else "off",
        list(sizes) or "none",
        list(full_sizes) or "none",
        "on" if graphs else "off",
    )
    log.info("kernels: %s (%s)", rc.ops.describe(), ", ".join(f"{k}={int(v)}" for k, v in rc.ops.fields().items()))
    return rc


def resolve_speculation(config: CompileConfig, k: int, measured: bool = False) -> tuple[int, ...]:
    """CompileConfig.speculation as the K a decode step may choose: () for "fixed" (or nothing to choose: no
    drafter, K = 0); {0, ceil(K/2), K} for "adaptive", logged. Refused where the ranks would have to agree on K
    (tensor parallelism, lock-stepped replicas): not built yet. "auto" is "adaptive" where start-up measures the
    step times (`measured`: CUDA graphs of the one-graph step captured at start-up) and no rank steps with another,
    else "fixed"."""
    if config.speculation == "fixed" or k == 0:
        return ()
    lockstep = config.tensor_parallel_size > 1 or (config.expert_parallel and config.data_parallel_size > 1)
    if config.speculation == "auto" and (lockstep or not measured):
        why = "ranks step together" if lockstep else "no step times measured here (CUDA graphs of the one-graph step)"
        log.info("speculation auto -> fixed: %s", why)
        return ()
    if lockstep:
        raise ValueError(
            f"speculation='adaptive' with tensor_parallel_size={config.tensor_parallel_size}, data_parallel_size="
            f"{config.data_parallel_size}, expert_parallel={config.expert_parallel}: ranks that step together would "
            "each pick K from their own timings, which is not supported yet; use speculation='fixed' there "
            "(independent data-parallel replicas, without expert_parallel, adapt each on its own)"
        )
    ks = tuple(sorted({0, -(-k // 2), k}))
    log.info("speculation adaptive: each decode step picks K from %s by measured step times and acceptance", list(ks))
    return ks


def auto_mode(device: torch.device, artifact_mode: str | None = None) -> tuple[CUDAGraphMode, str]:
    """What mode "auto" means here, and why."""
    if artifact_mode is not None:
        return CUDAGraphMode(artifact_mode), "the mode the artifacts were built with"
    if device.type == "cuda":
        return (
            CUDAGraphMode.FULL_AND_PIECEWISE,
            "a CUDA device: FULL graphs for uniform batches, PIECEWISE for the rest",
        )
    return CUDAGraphMode.NONE, f"no CUDA graphs on {device.type}, where compiling would only add start-up time"


def fuse_loop(config: CompileConfig) -> bool:
    """fuse_draft_loop with "auto" decided: fused only when the one-graph step is off (config.py's comment)."""
    if config.fuse_draft_loop == "auto":
        return not config.one_graph_step
    return bool(config.fuse_draft_loop)


def check_parallel(tp: int, draft_tp: int | None) -> None:
    """The target's TP is at least 1; the drafter's is the target's (sharded alike) or 1 (replicated)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be at least 1 (1 = one device, no worker processes)")
    if draft_tp is not None and draft_tp not in (1, tp):
        raise ValueError(
            f"draft_tensor_parallel_size={draft_tp} with tensor_parallel_size={tp}: the drafter is either split "
            f"like the target or replicated on every rank; allowed: {sorted({1, tp})} (None = the target's)"
        )


def check_data_parallel(dp: int, tp: int, expert_parallel: bool) -> None:
    """Data-parallel replicas number at least 1; expert parallelism spreads the experts over all tp x dp ranks
    (models/parallel/experts.py), so it needs at least two."""
    if dp < 1:
        raise ValueError(f"data_parallel_size={dp} must be at least 1 (1 = one engine replica, no data parallelism)")
    if expert_parallel and dp * tp < 2:
        raise ValueError(
            f"expert_parallel=True with tensor_parallel_size={tp} and data_parallel_size={dp}: experts are split "
            "across the tp x dp ranks, so it needs at least two (e.g. --tp 2 --expert-parallel or --dp 2 "
            "--expert-parallel), or turn expert_parallel off"
        )


MAX_NGRAM = 16  # the longest n-gram the n-gram drafter matches: each size is one comparison over the history per step


def check_ngram_sizes(n_min: int, n_max: int) -> None:
    """CompileConfig.ngram_min / ngram_max (drafter="ngram"): 1 <= ngram_min <= ngram_max <= MAX_NGRAM."""
    for name, n in (("ngram_min", n_min), ("ngram_max", n_max)):
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"{name}={n!r} must be an int (an n-gram length in tokens), e.g. {name}=3")
    if not 1 <= n_min <= n_max <= MAX_NGRAM:
        raise ValueError(
            f"ngram_min={n_min}, ngram_max={n_max}: the n-gram sizes must satisfy 1 <= ngram_min <= ngram_max <= "
            f"{MAX_NGRAM}; e.g. ngram_min=1, ngram_max=3"
        )


def check_synthetic_acceptance(rates) -> None:
    """CompileConfig.synthetic_acceptance: a tuple of conditional rates, each in [0, 1]."""
    if not isinstance(rates, tuple) or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates):
        raise TypeError(
            f"synthetic_acceptance={rates!r} must be a tuple of conditional acceptance rates per draft position, "
            "e.g. (0.73, 0.71, 0.68), or () for real acceptance"
        )
    bad = [r for r in rates if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(
            f"synthetic_acceptance={rates}: rates {bad} lie outside [0, 1]; each is the probability that draft i is "
            "accepted given drafts 0..i-1 were"
        )


def resolve_synthetic_acceptance(rates: tuple[float, ...], k: int) -> tuple[float, ...]:
    """The pinned rates, checked against K (0 without a drafter) and announced loudly: results with them are
    benchmarks of step time, not of a drafter's quality."""
    if not rates:
        return ()
    if len(rates) > k:
        raise ValueError(
            f"synthetic_acceptance has {len(rates)} rates but K (num_speculative_tokens, with a drafter) is {k}; "
            f"give at most {k} rates (positions past them are rejected)" + (", and a drafter" if not k else "")
        )
    mean = expected_acceptance_length(rates)
    log.warning(
        "PINNED ACCEPTANCE (benchmarks only): synthetic_acceptance=%s, the accept decision is drawn, not made by the "
        "target; expected mean acceptance length %.3f of K=%d. Greedy requests only; outputs are not the target's.",
        list(rates),
        mean,
        k,
    )
    return tuple(float(r) for r in rates)


def _prefix_products(rates) -> list[float]:
    """P(draft i accepted) = rate_0 x ... x rate_i for each i."""
    out, p = [], 1.0
    for r in rates:
        p *= r
        out.append(p)
    return out


def expected_acceptance_length(rates) -> float:
    """Mean tokens per verify step under pinned conditional rates: 1 + sum_i prod_{j<=i} rate_j."""
    return 1.0 + sum(_prefix_products(rates))


def check_speculative(config: CompileConfig) -> None:
    """The checks on K, which apply only when there is a drafter."""
    k = config.num_speculative_tokens
    if not 0 <= k <= 8:
        raise ValueError(f"num_speculative_tokens={k} must lie in [0, 8]; e.g. 3")
    needed = config.max_num_seqs * (k + 1)
    if config.max_num_batched_tokens < needed:
        raise ValueError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} cannot hold a full decode batch: "
            f"max_num_seqs x (1 + K) = {config.max_num_seqs} x {k + 1} = {needed}; raise it to at least {needed} "
            "or lower max_num_seqs or num_speculative_tokens"
        )


def auto_capture_sizes(max_tokens: int, device_type: str) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16 up to max_tokens on CUDA; powers of two up to 64 on the CPU (no graphs
    there: padding to a size only costs work, so fewer, coarser sizes)."""
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
