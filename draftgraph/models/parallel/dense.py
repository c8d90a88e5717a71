"""Tensor parallelism: per-rank configs, parallel layers and checkpoint slicing (the Llama family here,
DeepSeek-V3 / V3.2's MLA and experts in parallel/mla.py, Qwen3.5's linear attention in parallel/hybrid.py).

With a `ParallelGroup` of world size W, rank r holds:
- attention: query heads [r*Hq/W, (r+1)*Hq/W) and KV heads [r*Hkv/W, (r+1)*Hkv/W) (whole heads, whole GQA
  groups), so q/k norms, RoPE and paged attention run on local heads unchanged and the KV cache holds only
  the local KV heads; the fused QKV projection is column-parallel per part (q, k and v each cut by heads);
- the MLP: columns [r*I/W, (r+1)*I/W) of both gate and up (matching halves), rows of down;
- the output and down projections are row-parallel: a local matmul, `all_reduce`, then the bias once;
- the embedding: vocabulary rows [r*V/W, (r+1)*V/W) (ids outside the range look up zeros; `all_reduce`);
- the LM head: the same vocabulary rows; local logits, then `all_gather_last` gives every rank the full
  [N, V] logits, so sampling (and its greedy tokens) is identical on every rank.

The per-rank `ModelConfig` (`shard_config`) says num_heads, num_kv_heads and intermediate_size per rank and
`tp_size = W`; `kv_entry_shapes` and the KV cache's sizing follow from it. vocab_size stays the full
vocabulary (what the logits have). Every family splits. How each stored tensor is cut is one description
(`tensor_cut`, a models/shard_cut.Cut): `shard_state` applies it to whole tensors in memory, and
models/parallel/sharded_read.py reads only that share from a safetensors checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftgraph.models.config import ModelConfig
from draftgraph.models.families import family_of
from draftgraph.models.linear import Linear, project
from draftgraph.models.parallel.mla import deepseek_cut
from draftgraph.models.parallel.shard_cut import Cut, split_cut, take
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import ParallelGroup


def check_tensor_parallel(cfg: ModelConfig, tp: ParallelGroup) -> None:
    """Refuse a tensor-parallel size this model cannot be split by, naming the numbers."""
    if tp.is_single:
        return
    if cfg.tp_size != 1:
        raise ValueError(f"this ModelConfig is already one rank's share (tp_size={cfg.tp_size}); pass the full one")
    sizes = family_of(cfg).share.sizes(cfg)
    bad = [f"{name}={n}" for name, n in sizes if n % tp.world_size]
    if bad:
        fits = [w for w in range(1, cfg.num_kv_heads + 1) if all(n % w == 0 for _, n in sizes)]
        raise ValueError(
            f"tensor-parallel size {tp.world_size} does not divide {', '.join(bad)} of {cfg.model_type}; "
            f"each rank needs whole heads and equal shares: use a tp that divides them all (here: {fits})"
        )


def shard_config(cfg: ModelConfig, tp: ParallelGroup) -> ModelConfig:
    """One rank's config: heads, KV heads and intermediate size divided by the world size (checked first)."""
    check_tensor_parallel(cfg, tp)
    if tp.is_single:
        return cfg
    return family_of(cfg).share.scale(cfg, tp.world_size, False)


def full_config(cfg: ModelConfig) -> ModelConfig:
    """The whole model's config from one rank's share (`shard_config`'s inverse; `cfg` itself for one process).
    Drafters that read the target's shape (EAGLE's defaults) start from it, then take their own share."""
    if cfg.tp_size == 1:
        return cfg
    return family_of(cfg).share.scale(cfg, cfg.tp_size, True)


def dense_sizes(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The sizes a Llama-family tensor-parallel size must divide."""
    return (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    )


def scale_dense_config(cfg: ModelConfig, w: int, up: bool) -> ModelConfig:
    """Heads, KV heads and intermediate size divided by `w` (one rank's share) or multiplied back."""

    def f(n: int) -> int:
        return n * w if up else n // w

    return cfg.replace(
        num_heads=f(cfg.num_heads),
        num_kv_heads=f(cfg.num_kv_heads),
        intermediate_size=f(cfg.intermediate_size),
        tp_size=1 if up else w,
    )


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: input features split over ranks, the bias added once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup, ops: OpChoices = DEFAULT_OPS
    ):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(project(x, self.weight, None, self.ops))
        return y if self.bias is None else y + self.bias


def row_linear(
    in_features: int, out_features: int, bias: bool, tp: ParallelGroup, ops: OpChoices = DEFAULT_OPS
) -> nn.Linear:
    """A row-parallel linear over `in_features` local inputs (nn.Linear itself for one process)."""
    if tp.is_single:
        return Linear(in_features, out_features, bias=bias, ops=ops)
    return RowParallelLinear(in_features, out_features, bias, tp, ops)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [rank*V/W, (rank+1)*V/W) of the embedding; other ids give zeros; summed over ranks."""

    def __init__(self, vocab_size: int, dim: int, tp: ParallelGroup):
        super().__init__()
        self.local = vocab_size // tp.world_size
        self.start = tp.rank * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dim))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        valid = (local >= 0) & (local < self.local)
        out = F.embedding(torch.where(valid, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(out * valid.unsqueeze(-1).to(out.dtype))


def embedding(vocab_size: int, dim: int, tp: ParallelGroup) -> nn.Module:
    """The token embedding: vocabulary-parallel over several ranks, nn.Embedding for one. Built under
    `torch.device("meta")` (shapes only, the weights assigned later), its weight is not initialised: on the meta
    device nn.Embedding's normal_ runs torch's Python reference, whose first call imports Dynamo (a second of a
    start that compiles nothing)."""
    if not tp.is_single:
        return VocabParallelEmbedding(vocab_size, dim, tp)
    if torch.get_default_device().type == "meta":
        return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
    return nn.Embedding(vocab_size, dim)


# transformers' Llama-family names -> how a rank slices them: rows (dim 0) or columns (dim 1) of its share.
_ROW_SPLIT = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_COL_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB_SPLIT = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "lm_head.weight")


def shard_dim(name: str) -> int | None:
    """The dim a transformers-named Llama-family tensor is split along (None: every rank holds all of it).
    Row-parallel biases (o_proj, down_proj) are whole: RowParallelLinear adds them once after the sum."""
    if name in _VOCAB_SPLIT or any(s in name for s in _ROW_SPLIT):
        return 0
    if any(name.endswith(s) for s in _COL_SPLIT):
        return 1
    return None


def tensor_cut(name: str, shape: tuple[int, ...], tp: ParallelGroup, cfg: ModelConfig | None = None) -> Cut | None:
    """How rank `tp.rank` cuts the transformers-named tensor of (whole) `shape`, None when it holds all of it:
    the names only the family of the whole model's `cfg` has by its own rule (`Family.share.cut`: DeepSeek's MLA
    and experts in parallel/mla.py, Qwen3.5's in parallel/hybrid.py), the rest by the Llama family's (`shard_dim`).
    Without a `cfg`, the rules that go by name alone: DeepSeek's, then the Llama family's."""
    if tp.is_single:
        return None
    if cfg is None:  # the family unknown: the rules that go by name alone
        cut = deepseek_cut(name, shape, tp.rank, tp.world_size)
    else:
        own = family_of(cfg).share.cut
        cut = None if own is None else own(name, shape, tp.rank, tp.world_size, cfg)
    if cut is not None:
        return cut
    dim = shard_dim(name)
    return None if dim is None else split_cut(name, shape, dim, tp.rank, tp.world_size)


def shard_tensor(name: str, t: torch.Tensor, tp: ParallelGroup, cfg: ModelConfig | None = None) -> torch.Tensor:
    """Rank `tp.rank`'s slice of the transformers-named tensor (a copy, so the full tensor can be freed; the
    tensor itself when every rank holds all of it), by `tensor_cut`."""
    return take(t, tensor_cut(name, tuple(t.shape), tp, cfg))


def shard_state(
    state: dict[str, torch.Tensor], tp: ParallelGroup, cfg: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers-named state dict (of the whole model `cfg`) cut to this rank's share.
    q/k/v (and gate/up) are cut separately before our loader fuses them, so the fused QKV holds this rank's q
    heads then its KV heads, and gate_up its matching gate and up columns."""
    if tp.is_single:
        return state
    return {name: shard_tensor(name, t, tp, cfg) for name, t in state.items()}
