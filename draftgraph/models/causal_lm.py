"""The one causal LM over the flat token layout, for every family (models/families/: Llama 2/3, Qwen2, Qwen3,
Mistral; DeepSeek-V3 and V3.2; Qwen3.5 hybrids): the family of the config gives its decoder layers, final norm
and checkpoint names.

forward(input_ids[T], positions[T], meta, kv_caches) returns the final normed hidden states [T, H]
plus the residual stream after each layer in `aux_layers` (EAGLE-3 reads three of them). Logits are a
separate call on chosen rows only, so a decode step never materializes [T, vocab].

Tensor parallelism (every family; models/parallel/dense.py, parallel/mla.py, parallel/hybrid.py): `tp` (a
ParallelGroup) on the constructors; each rank builds its share from the full weights, and compute_logits
all-gathers the vocabulary so every rank returns the full logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftgraph.models.config import ModelConfig
from draftgraph.models.families import family_of
from draftgraph.models.generation_config import checkpoint_generation_eos, merge_eos, model_generation_eos
from draftgraph.models.layers import DecoderLayer, RMSNorm, materialize, rope_lookup
from draftgraph.models.linear import head_logits
from draftgraph.models.parallel.dense import embedding, shard_config, shard_state
from draftgraph.models.weights import assign_weights, layer_indices, read_checkpoint, read_target_config
from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding when configured).

    With a tensor-parallel `tp`, `cfg` is this rank's share (parallel.shard_config) and the embedding and LM
    head hold this rank's vocabulary rows. `ops`: which of draftgraph's kernels its layers use on CUDA
    (ops/choices.py; `ResolvedConfig.ops` when an engine builds it)."""

    def __init__(
        self, cfg: ModelConfig, attn_impl: str = "reference", tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS
    ):
        super().__init__()
        if cfg.tp_size != tp.world_size:
            raise ValueError(
                f"cfg.tp_size={cfg.tp_size} but tp.world_size={tp.world_size}: build the model from "
                "parallel.shard_config(full_cfg, tp), or through from_state_dict / from_pretrained / from_hf"
            )
        self.cfg = cfg
        self.tp = tp
        self.ops = ops
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        family = family_of(cfg)
        self.layers = nn.ModuleList(family.make_layer(cfg, i, attn_impl, tp, ops) for i in range(cfg.num_layers))
        # The final RMSNorm: Qwen3.5's is zero-centred (x * (1 + w)).
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=family.zero_centered_norm, ops=ops)
        local_vocab = cfg.vocab_size // tp.world_size
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, local_vocab, bias=False)
        self.register_buffer("rope_table", torch.empty(cfg.max_position_embeddings, cfg.rotary_dim), persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cos, sin = rope_lookup(self.rope_table, positions)  # [T, D/2] each
        h = self.embed_tokens(input_ids)  # [T, H]
        outs = {}
        if self.sums_in_norms(h):
            delta, summed = None, True
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                delta, h = layer.forward_unsummed(delta, h, cos, sin, meta, kv_caches[i], summed, i == last)
                summed = not layer.sends_partials(h)  # a partial: the next layer's input norm sums it
                if i in aux_layers:
                    outs[i] = h + (delta if summed else self.tp.all_reduce(delta))
            if not summed:  # the last layer's down: a plain all_reduce before the final norm
                delta = self.tp.all_reduce(delta)
            return self.norm.add_forward(delta, h)[1], [outs[i] for i in aux_layers]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, kv_caches[i])
            if i in aux_layers:
                outs[i] = h
        # In the order asked, repeats included (EAGLE-3's defaults repeat a layer in small models).
        return self.norm(h), [outs[i] for i in aux_layers]

    def sums_in_norms(self, h: torch.Tensor) -> bool:
        """Whether each layer's residual add is left to the next layer's input norm (and the last one's to the
        final norm): on CUDA with the norm ops, for Llama-family layers that all have an input norm."""
        return (
            h.is_cuda
            and self.ops.norm_kernel
            and len(self.layers) > 0
            and not self.norm.zero_centered
            and all(type(layer) is DecoderLayer and layer.input_norm is not None for layer in self.layers)
        )

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] for hidden rows `indices` (all rows when None); the full vocabulary on every
        tensor-parallel rank (local rows' logits, then all_gather_last)."""
        if indices is not None:
            hidden = hidden[indices]
        return self.tp.all_gather_last(head_logits(hidden, self.head_weight, self.ops))

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        state: dict[str, torch.Tensor],
        device="cpu",
        attn_impl: str = "reference",
        tp: ParallelGroup = SINGLE,
        sharded: bool = False,
        ops: OpChoices = DEFAULT_OPS,
    ) -> CausalLM:
        """Build from a transformers-named state dict (`model.layers.N...`, `lm_head.weight`) and the full
        model's `cfg`; with a tensor-parallel `tp`, this rank's share (each tensor sliced, then copied), or
        `state` as it is when `sharded` (already this rank's share: sharded_read.read_target_share)."""
        local_cfg = shard_config(cfg, tp)  # refuses families and sizes tp cannot split
        state = dict(state) if sharded else shard_state(dict(state), tp, cfg)
        cfg = local_cfg
        family = family_of(cfg)
        if family.normalize_keys is not None:  # Qwen3.5: the multimodal layout's text part; no MTP or vision weights
            state = family.normalize_keys(state)
        ours: dict[str, torch.Tensor] = {}
        for i in layer_indices(state, "model.layers."):
            if i >= cfg.num_layers:  # an MTP layer stored after the decoder (DeepSeek layout): not ours
                for k in [k for k in state if k.startswith(f"model.layers.{i}.")]:
                    state.pop(k)
                continue
            ours.update(family.convert_layer(state, f"model.layers.{i}.", f"layers.{i}."))
        for theirs, mine in (
            ("model.embed_tokens.weight", "embed_tokens.weight"),
            ("model.norm.weight", "norm.weight"),
            ("lm_head.weight", "lm_head.weight"),
        ):
            if theirs in state:
                ours[mine] = state.pop(theirs)
        if cfg.tie_word_embeddings:
            ours.pop("lm_head.weight", None)
        ours.update(state)  # anything left over is reported as unexpected by assign_weights
        with torch.device("meta"):
            model = cls(cfg, attn_impl, tp, ops)
        assign_weights(model, ours, f"{cfg.model_type} target", cfg.dtype)
        return materialize(model, cfg, device)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype=None,
        device="cpu",
        attn_impl="reference",
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ) -> CausalLM:
        """From a checkpoint directory. With a tensor-parallel `tp`, each rank reads only its share of the
        split tensors (models/parallel/sharded_read.py, every family). Onto a CUDA device the tensors are read
        straight there (models/mapped_read.py: one host copy, through pinned buffers)."""
        cfg = ModelConfig.from_hf(read_target_config(path), dtype=dtype)
        cfg = cfg.replace(eos_token_ids=merge_eos(cfg.eos_token_ids, checkpoint_generation_eos(path)))
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if tp.is_single and not on_cuda:
            return cls.from_state_dict(cfg, read_checkpoint(path), device, attn_impl, tp, ops=ops)
        shard_config(cfg, tp)  # sizes tp cannot split are refused before anything is read
        from draftgraph.models.parallel.sharded_read import read_target_share

        state = read_target_share(path, cfg, tp, device=device if on_cuda else None)
        return cls.from_state_dict(cfg, state, device, attn_impl, tp, sharded=True, ops=ops)

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        dtype=None,
        device=None,
        attn_impl="reference",
        tp: ParallelGroup = SINGLE,
        ops: OpChoices = DEFAULT_OPS,
    ) -> CausalLM:
        """From a transformers *ForCausalLM object in memory (weights copied by reference when possible; with
        a tensor-parallel `tp`, copies of this rank's slices)."""
        param = next(hf_model.parameters())
        cfg = ModelConfig.from_hf(hf_model.config, dtype=dtype or param.dtype)
        cfg = cfg.replace(eos_token_ids=merge_eos(cfg.eos_token_ids, model_generation_eos(hf_model)))
        return cls.from_state_dict(cfg, hf_model.state_dict(), device or param.device, attn_impl, tp, ops=ops)
