"""This expert-parallel rank's routed experts, whole, read from the target's source (models/parallel/experts.py).

Under tensor parallelism a rank loads its TP share of the target, whose MoE layers hold a slice of every
expert's intermediate dimension; expert parallelism across the TP ranks needs this rank's experts whole instead.
`local_experts` reads just those experts, [first, first + n) of every listed MoE layer:
- a checkpoint directory (safetensors): the per-expert tensors of those experts only (the hub's layout and what
  save_pretrained writes), or rows [first, first + n) of the fused tensors through `get_slice` (the other
  experts' bytes are never copied); a `pytorch_model.bin` is read whole, then cut;
- a transformers object: views of its state dict, cut.
Names are transformers' (`model.layers.L.mlp.experts...`, or `model.language_model.layers...` in Qwen3.5's
multimodal layout); gate and up are fused as the family converters fuse them (gate rows, then up rows).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from draftgraph.models.weights import CheckpointError, check_weight_files, read_checkpoint

_PREFIX = r"^(?:model\.language_model\.|model\.)layers\.(\d+)\.mlp\.experts\."
_PER_EXPERT = re.compile(_PREFIX + r"(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(_PREFIX + r"(gate_up|down)_proj$")

Experts = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (gate_up [n, 2I, H], down [n, H, I])


def local_experts(source: Any, layers: set[int], first: int, n: int) -> Experts:
    """(gate_up, down) of experts [first, first + n) for each decoder layer in `layers`, from a checkpoint
    directory or a transformers model object (see the module docstring)."""
    parts: dict[int, dict] = {layer: {} for layer in layers}

    def take(name: str, whole: Callable[[], torch.Tensor], rows: Callable[[], torch.Tensor]) -> None:
        m = _PER_EXPERT.match(name)
        if m is not None:
            layer, e = int(m.group(1)), int(m.group(2))
            if layer in parts and first <= e < first + n:
                parts[layer][(m.group(3), e)] = whole()
            return
        m = _FUSED.match(name)
        if m is not None and int(m.group(1)) in parts:
            parts[int(m.group(1))][m.group(2)] = rows()

    if isinstance(source, str):
        files = check_weight_files(source)
        if not files:  # pytorch_model.bin: no partial reads
            for name, t in read_checkpoint(source).items():
                take(name, lambda t=t: t, lambda t=t: t[first : first + n])
        for file in files:
            from safetensors import safe_open

            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                        take(name, lambda k=name: f.get_tensor(k), lambda k=name: f.get_slice(k)[first : first + n])
            except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
                raise CheckpointError(f"{file} could not be read ({e}); download or save the checkpoint again") from e
    else:
        for name, t in source.state_dict().items():
            take(name, lambda t=t: t, lambda t=t: t[first : first + n].clone())
    return {layer: _assemble(layer, p, first, n) for layer, p in parts.items()}


def _assemble(layer: int, p: dict, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if "gate_up" in p and "down" in p:
        return p["gate_up"], p["down"]
    missing = [f"experts.{e}.{proj}_proj" for e in range(first, first + n) for proj in ("gate", "up", "down")
               if (proj, e) not in p]  # fmt: skip
    if missing:
        raise CheckpointError(
            f"layer {layer}'s routed experts {first}-{first + n - 1} are not all in the checkpoint (missing "
            f"{missing[:4]}{'...' if len(missing) > 4 else ''}); expected the fused mlp.experts.gate_up_proj / "
            "down_proj or one mlp.experts.E.{gate,up,down}_proj.weight per expert"
        )
    experts = range(first, first + n)
    gate_up = torch.stack([torch.cat([p[("gate", e)], p[("up", e)]], dim=0) for e in experts])
    return gate_up, torch.stack([p[("down", e)] for e in experts])
