"""OpChoices: which of draftgraph's own kernels the models and the runtime use, one frozen record.

Every choice here changes a traced graph or a kernel, so it is resolved once (`CompileConfig.ops` ->
`ResolvedConfig.ops`, compiler/config.py), logged, passed to the model constructors and the runtime as an
argument, and recorded in an artifact's manifest (`config: ops.gemv True != False`). Each kernel is used on
CUDA only, whatever its flag: off CUDA (the CPU, CI) traces name the torch ops as they always did. The
defaults are the measured winners (docs/performance.md); turning one off runs the torch ops instead, for
comparisons (`scripts/bench_step.py`'s variants, `draftgraph --ops gemv=0,...`).

- `gemv`: the models' linear layers and LM heads run `draftgraph::linear` (a Triton GEMV for a few rows,
  cuBLAS for more: ops/linear), not F.linear; the MLP's activation and down projection one
  `draftgraph::silu_mul_linear`.
- `norm_kernel`: RMSNorm and the residual add before it run `draftgraph::rms_norm` / `add_rms_norm`
  (ops/norm: one Triton kernel each), not torch ops; each layer's residual sum is left to the next norm.
- `rope_kernel`: the Llama attention's RoPE on q and k and the copy of v run `draftgraph::rope_qkv`
  (ops/rope: one kernel), not torch ops.
- `norm_in_projection`: a Llama layer's pre-norms and the projections after them (qkv, gate_up) run as one
  `draftgraph::add_rms_norm_linear` each (the norm inside the one-row GEMV); needs `norm_kernel` and `gemv`.
- `rope_kv_write`: the RoPE kernel also writes k and v into the paged caches (`draftgraph::rope_qkv_write`,
  with the Triton attention), not the attention op's own write; needs `rope_kernel`.
- `race_sampler`: eager token draws on CUDA run the Triton exponential race (`draftgraph::race_sample`,
  ops/sampling/triton_race.py), not torch ops over [N, V] noise.
- `logits_kernels`: the step's logits processing (penalties, logit bias, min_tokens) and logprobs gather on CUDA run
  the Triton kernels of ops/logits (one read and one write of the logits; one read), not torch ops.
- `fuse_all_reduce`: under tensor parallelism with a peer all-reduce, a Llama
  layer's one-row all-reduces after o_proj and down run inside the GEMVs around them (ops/collectives/fused.py:
  `draftgraph::linear_send` writes the lamport rows, `draftgraph::all_reduce_add_rms_norm_linear` sums them in the
  next norm + projection): no all-reduce launch at batch 1; more rows keep the all_reduce op. Needs
  `norm_in_projection` (and its needs). On 2 x H200 (8B, TP 2, batch 1) 0-40 us a step faster, never slower
  (docs/performance.md, "Tensor parallelism").
- `rope_in_projection`: a Llama layer's input norm, QKV projection, RoPE and KV write run as one
  `draftgraph::add_rms_norm_qkv_rope_write` (one kernel at one row: ops/linear/triton_qkv.py, the RoPE kernel's work
  in the norm GEMV's epilogue); needs `norm_in_projection` and `rope_kv_write`. On an H200 (8B, batch 1) 33-40 us a
  step faster at TP 1, 0-25 us at TP 2.
- `unfuse_addmm`: Inductor keeps a residual add apart from its matmul (passes/unfuse_addmm.py, installed as
  Inductor's post-grad pass) instead of fusing it into cuBLAS addmm (a copy of the residual first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
# The fields a model's layers read (the rest are the runtime's and Inductor's).
MODEL_FIELDS = (
    "gemv",
    "norm_kernel",
    "rope_kernel",
    "norm_in_projection",
    "rope_kv_write",
    "fuse_all_reduce",
    "rope_in_projection",
)


@dataclass(frozen=True)
class OpChoices:
    """Which of draftgraph's kernels run (on CUDA); every field on by default (module docstring)."""

    gemv: bool = True
    norm_kernel: bool = True
    rope_kernel: bool = True
    norm_in_projection: bool = True
    rope_kv_write: bool = True
    race_sampler: bool = True
    unfuse_addmm: bool = True
    logits_kernels: bool = True
    fuse_all_reduce: bool = True
    rope_in_projection: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"OpChoices.{f.name}={value!r} must be True or False (e.g. OpChoices({f.name}=False) runs the "
                    "torch ops instead of draftgraph's kernel)"
                )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def parse(cls, spec: str) -> OpChoices:
        """`"gemv=0,rope_kv_write=off"` -> OpChoices with those fields set, the rest at their defaults ("" = all
        defaults)."""
        values: dict[str, bool] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, flag = item.partition("=")
            name, flag = name.strip(), flag.strip().lower()
            if not sep or name not in cls.names() or flag not in _TRUE + _FALSE:
                raise ValueError(
                    f"ops entry {item!r} is not NAME=0 or NAME=1 with NAME one of {list(cls.names())}; "
                    "e.g. --ops gemv=0,rope_kv_write=0"
                )
            values[name] = flag in _TRUE
        return cls(**values)

    def describe(self) -> str:
        """One line for the log: "all draftgraph kernels", or the ones turned off (and the default-off ones on)."""
        fields = dataclasses.fields(self)
        off = [f.name for f in fields if f.default and not getattr(self, f.name)]
        on = [f.name for f in fields if not f.default and getattr(self, f.name)]
        text = "all draftgraph kernels (on CUDA)" if not off else "torch ops instead of " + ", ".join(off)
        return text + "".join(f", {name} on" for name in on)

    def fields(self) -> dict[str, bool]:
        return dataclasses.asdict(self)


DEFAULT_OPS = OpChoices()


def check_op_choices(model, ops: OpChoices, what: str) -> None:
    """A model passed in already built (`what`: "the target", "the drafter") runs the kernels it was built with:
    refuse it when its layers' choices (MODEL_FIELDS) are not `ops`'s, the resolved configuration's, which the
    engine records and compiles for."""
    built = getattr(model, "ops", DEFAULT_OPS)
    differ = [k for k in MODEL_FIELDS if getattr(built, k) != getattr(ops, k)]
    if differ:
        diff = ", ".join(f"{k}={getattr(built, k)}" for k in differ)
        want = ", ".join(f"{k}={getattr(ops, k)}" for k in differ)
        raise ValueError(
            f"{what} was built with ops {diff}, but the configuration resolves ops {want}: build it with "
            f"ops=OpChoices(...) as the configuration's (CompileConfig.ops), or pass CompileConfig(ops=...) matching it"
        )
