"""Inductor settings every piece is compiled with: draftgraph's measured defaults, or a user's own.

Measured on an H100 with scripts/bench_inductor_options.py, bench_step.py and a cold `draftgraph generate
--device cuda` (docs/history/benchmarks-2026-11.md, 2026-11-23), none of the candidates paid, so the defaults
are Inductor's own:
- `triton.autotune_pointwise=False` (one launch config per pointwise kernel, no first-call benchmarking): the
  built-in pair ready in 41.0 s instead of 55.5 s from empty caches, but the 1B-shaped pair's B=1 decode step
  6-12 % slower. Step time wins; a user who wants the faster start passes it (--inductor-option).
- `split_reductions=False` (one kernel per norm instead of two): B=1 step 13-20 % slower.
- `combo_kernels=True` (fewer launches): step time inconclusive (-13 % speculative, +23 % plain).
Keys this torch does not have are dropped from the defaults (torch 2.11-2.13 differ); a user's unknown key
is an error naming it.
"""

from __future__ import annotations

import contextlib

DEFAULT_INDUCTOR_OPTIONS: tuple[tuple[str, object], ...] = ()
_POST_GRAD = "post_grad_custom_post_pass"


def _has(key: str) -> bool:
    import torch._inductor.config as inductor_config

    obj = inductor_config
    for part in key.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def resolve_inductor_options(given, unfuse_addmm: bool = True) -> tuple[tuple[str, object], ...]:
    """None -> the defaults this torch knows; a tuple of (key, value) pairs -> checked, as given. With
    `unfuse_addmm` off (OpChoices.unfuse_addmm), Inductor's post-grad pass slot is pinned empty, so
    `inductor_patch` installs no pass (a user's own pass in `given` stays)."""
    if given is None:
        pairs = tuple((k, v) for k, v in DEFAULT_INDUCTOR_OPTIONS if _has(k))
    else:
        pairs = _checked(given)
    if not unfuse_addmm and all(k != _POST_GRAD for k, _ in pairs):
        pairs += ((_POST_GRAD, None),)
    return pairs


def _checked(given) -> tuple[tuple[str, object], ...]:
    pairs = tuple(tuple(p) for p in given)
    bad = [p for p in pairs if len(p) != 2 or not isinstance(p[0], str)]
    if bad:
        raise ValueError(
            f"inductor_options={given!r}: each entry must be a (key, value) pair, e.g. (('split_reductions', False),)"
        )
    unknown = [k for k, _ in pairs if not _has(k)]
    if unknown:
        raise ValueError(
            f"inductor_options names {unknown}, which torch._inductor.config of this torch does not have; check the "
            "spelling against torch._inductor.config (dotted keys for sub-configs, e.g. 'triton.max_tiles'), or "
            "pass None for draftgraph's defaults"
        )
    return pairs


def inductor_patch(options: tuple[tuple[str, object], ...]):
    """A context under which Inductor compiles with `options`, and with draftgraph's post-grad pass
    (passes/unfuse_addmm.py) unless the options name the post-grad pass slot (a user's own pass, or None where
    OpChoices.unfuse_addmm is off: resolve_inductor_options)."""
    patch = dict(options)
    if _POST_GRAD not in patch:
        from draftgraph.passes.unfuse_addmm import UnfuseResidualAddmm

        patch["post_grad_custom_post_pass"] = UnfuseResidualAddmm()
    if not patch:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(patch)


def loading_in_process():
    """Inductor's settings while this process loads compiled code (a compile worker's piece, an artifact's): one
    compile thread. The code's Triton kernels are in the caches the compile filled (the workers share this
    process's Triton cache; an artifact bundles its kernels), so loading them needs no compile subprocesses;
    with more threads Inductor starts its pool of them at the first load (16 processes importing torch beside
    the engine build on an H100, and waited for at exit: 10 s)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(compile_threads=1)
