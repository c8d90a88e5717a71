"""CompileConfig.inductor_options: resolved once, checked, and in force while every piece compiles."""

import pytest

import draftgraph as dg
from draftgraph.cli.flags import inductor_options as _inductor_options
from draftgraph.compiler.config import resolve
from draftgraph.compiler.inductor_options import DEFAULT_INDUCTOR_OPTIONS, resolve_inductor_options
from draftgraph.models.causal_lm import CausalLM
from tests.helpers import tiny_hf_model


def test_defaults_and_user_pairs_resolve():
    assert resolve_inductor_options(None) == DEFAULT_INDUCTOR_OPTIONS
    assert resolve_inductor_options(()) == ()
    given = (("split_reductions", False), ("triton.autotune_pointwise", False))
    assert resolve_inductor_options(given) == given
    rc = resolve(dg.CompileConfig(device="cpu", inductor_options=given), 4096, False)
    assert rc.inductor_options == given


def test_unknown_key_and_bad_pair_name_the_fix():
    with pytest.raises(ValueError, match=r"names \['split_reduction'\].*torch._inductor.config"):
        resolve_inductor_options((("split_reduction", False),))
    with pytest.raises(ValueError, match="must be a \\(key, value\\) pair"):
        resolve_inductor_options(("split_reductions",))


def test_cli_parses_key_value_literals():
    assert _inductor_options(None) is None
    assert _inductor_options(["split_reductions=False", "triton.max_tiles=2"]) == (
        ("split_reductions", False),
        ("triton.max_tiles", 2),
    )
    with pytest.raises(SystemExit, match="must be KEY=VALUE"):
        _inductor_options(["split_reductions"])


def test_every_piece_compiles_under_the_options(monkeypatch):
    import torch._inductor as inductor
    import torch._inductor.config as inductor_config

    real, seen = inductor.standalone_compile, []

    def recording(*args, **kwargs):
        seen.append(inductor_config.split_reductions)
        return real(*args, **kwargs)

    monkeypatch.setattr(inductor, "standalone_compile", recording)
    model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96, num_hidden_layers=3))
    config = dg.CompileConfig(
        mode="PIECEWISE", num_speculative_tokens=0, max_num_seqs=2, max_num_batched_tokens=32,
        capture_sizes=(4, 16), progress=False, inductor_options=(("split_reductions", False),),
    )  # fmt: skip
    eng = dg.compile_model(model, None, config)
    out = eng.generate([[1, 2, 3, 4, 5]], dg.SamplingParams(max_tokens=6))
    ref = dg.compile_model(model, None, dg.CompileConfig(mode="NONE", num_speculative_tokens=0, progress=False))
    assert out[0].token_ids == ref.generate([[1, 2, 3, 4, 5]], dg.SamplingParams(max_tokens=6))[0].token_ids
    # 3 layers: first, middle and last compute pieces compile once each (the checks piece has no tensor work)
    assert eng.stats()["compile"]["inductor_compiles"] == 3 == len(seen)
    assert seen == [False] * 3 and inductor_config.split_reductions is True  # patched only while compiling
