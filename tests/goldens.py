"""Golden inspections of the built-in tiny model pairs: every target family x drafter kind in FULL_AND_PIECEWISE,
DeepSeek-V3.2 (sparse MLA, models/builtin_deepseek.py) and Qwen3.5 (Gated DeltaNet, models/builtin_qwen3_5.py)
with their MTP drafters, and Llama's four drafter kinds in PIECEWISE too. (A PIECEWISE golden is its
FULL_AND_PIECEWISE golden without the FULL graph entries: every one of the 18 was, 2026-11-28; Llama's stand for the
mode's own build, and CI spends the rest's ~50 s on other tests.)

`python scripts/refresh_goldens.py` prints graph-diff's lines of fresh inspections against tests/golden/ and
writes nothing; with `--write` it rewrites the changed ones. tests/test_goldens.py compares fresh inspections
against tests/golden/.
"""

from __future__ import annotations

import os

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
KINDS = ("eagle", "eagle3", "mtp", "draft_model")
MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")  # modes that compile (NONE has nothing to inspect)
REFRESH = "python scripts/refresh_goldens.py"  # prints the diff, writes nothing; `--write` writes


def failure_message(name: str, lines: list[str]) -> str:
    """What a golden test says on a difference: the semantic diff first, then the commands that review it and,
    once reviewed, write it."""
    return (
        f"{name}: how the model compiles changed (graph-diff, golden -> fresh):\n  "
        + "\n  ".join(lines)
        + f"\nIf every change above is intended: review it for every case with `{REFRESH}` (prints the diff,"
        f" writes nothing), then write it with `{REFRESH} --write {name}`."
    )


def cases() -> list[tuple[str, str, str]]:
    full = MODES[1]
    own_mtp = [(f, "mtp", full) for f in ("deepseek_v32", "qwen3_5")]
    piecewise_too = [(f, k, m) for f in FAMILIES[:1] for k in KINDS for m in MODES[:1]]
    return [(f, k, full) for f in FAMILIES for k in KINDS] + own_mtp + piecewise_too


def case_name(family: str, kind: str, mode: str) -> str:
    return f"{family}-{kind}-{mode.lower()}"


def case_hf(family: str):
    """The case's target as a transformers model (random weights, seeded: the same on every call)."""
    if family == "deepseek_v32":
        from draftgraph.models.builtin_deepseek import builtin_deepseek_v32_hf

        return builtin_deepseek_v32_hf()
    if family == "qwen3_5":
        from draftgraph.models.builtin_qwen3_5 import builtin_qwen3_5_hf

        return builtin_qwen3_5_hf()
    from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target

    spec = BuiltinSpec(
        family=family,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        draft_layers=1,
        max_position_embeddings=256,
    )
    return builtin_hf_target(spec)


def inspect_case(family: str, kind: str, mode: str, out_dir: str, hf=None) -> dict:
    """Inspect the case into out_dir; `hf`: its transformers target when already built (case_hf)."""
    import draftgraph as dg
    from draftgraph.inspection.report import inspect_model
    from draftgraph.models.builtin import builtin_drafter
    from draftgraph.models.causal_lm import CausalLM

    target = CausalLM.from_hf(hf if hf is not None else case_hf(family))
    drafter = builtin_drafter(kind, target)
    config = dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=2,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        capture_sizes=(1, 2, 4, 8, 16, 32),
        compile_backend="eager",
        progress=False,
    )
    return inspect_model(target, drafter, config, out_dir)


def golden_dir(root: str, family: str, kind: str, mode: str) -> str:
    return os.path.join(root, case_name(family, kind, mode))
