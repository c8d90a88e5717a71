"""Compile workers (compiler/pool/compile_pool.py): pieces compiled in other processes give the tokens of the
uncompiled engine, every piece goes to a worker (no fallback), artifacts save and load from them; a piece's
inputs travel as data with their symbols; a dead worker's piece compiles in-process; bad settings named."""

import os
import signal
from types import SimpleNamespace

import pytest
import torch

import draftgraph as dg
from draftgraph.artifacts.store import build_artifacts
from draftgraph.compiler.piece_inputs import NotPortable, encode_inputs, rebuild_inputs
from draftgraph.compiler.pool import pool_lifetime
from draftgraph.compiler.pool.compile_pool import CompilePool, wait_stopped
from draftgraph.compiler.pool.pool_lifetime import auto_workers, prestart, shared_workers, start_pool
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged


def _tokens(engine):
    prompts, params, arrivals = ragged(8)
    return [o.token_ids for o in engine.generate(prompts, params, arrivals)]


def test_pieces_compiled_by_workers_match_and_save(tmp_path):
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    base = dict(num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64, progress=False)
    ref = _tokens(dg.compile_model(target, drafter, dg.CompileConfig(mode="NONE", **base)))
    config = dg.CompileConfig(mode="PIECEWISE", capture_sizes=(4, 16), compile_workers=2, **base)
    early = prestart(2, "cpu")  # as the CLI does before it imports torch: the build takes this pool
    engine = dg.compile_model(target, drafter, config)
    assert early.closed and not pool_lifetime._prestarted
    c = engine.stats()["compile"]
    assert c["compile_workers"] == 2 and c["compile_worker_failures"] == 0
    # one symbolic compile per unique piece with kernels, each done by a worker and timed there
    assert c["inductor_compiles"] == len(c["piece_compile_seconds"]) - _host_only(engine) >= 2
    assert engine.compiled.pool is None  # closed when the compile phase ended
    t = c["compile_pool"]  # the workers' timeline: ready, first sent, last done, in seconds from their start
    assert t["workers"] == 2 and t["pieces"] == c["inductor_compiles"] and t["threads_per_worker"] >= 1
    assert t["taken_s"] >= 0  # the prestarted pool did the compiles
    assert 0 < t["ready_s"][0] <= t["ready_s"][1] and t["first_submitted_s"] < t["last_done_s"]
    assert 0 < t["piece_seconds"][0] <= t["piece_seconds"][1] <= t["piece_seconds"][2]
    assert "waiting for 2 compile workers" in engine.warm_up_report
    assert wait_stopped() == 0  # and its processes gone (the KV cache is sized after this on CUDA)
    assert _tokens(engine) == ref
    build_artifacts(engine, str(tmp_path / "a"))  # the workers' artifacts are what gets written
    loaded = dg.compile_model(target, drafter, config, artifacts=str(tmp_path / "a"), strict_artifacts=True)
    assert loaded.compiled.counters.inductor_compiles == 0 and not loaded.compiled.counters.traces
    assert _tokens(loaded) == ref


def test_engines_built_in_a_shared_workers_block_take_one_pool():
    """pool_lifetime.shared_workers: two builds inside the block use its one pool, which stays running
    between them and closes at the block's end; the second compiles nothing (every piece is the first's:
    pool_lifetime.shared_pieces); a build with other Inductor settings in the block, or with other worker
    settings (its own pool), compiles its own."""
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    base = dict(num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64, progress=False)
    ref = _tokens(dg.compile_model(target, drafter, dg.CompileConfig(mode="NONE", **base)))
    config = dg.CompileConfig(mode="PIECEWISE", capture_sizes=(4, 16), compile_workers=2, **base)
    tuned = dg.CompileConfig(
        mode="PIECEWISE", capture_sizes=(4, 16), compile_workers=2, inductor_options=(("max_autotune", False),), **base
    )
    with shared_workers(2, device="cpu") as pool:
        first = dg.compile_model(target, drafter, config)
        assert not pool.closed and pool.usable()
        second = dg.compile_model(target, drafter, config)
        other_options = dg.compile_model(target, drafter, tuned)
        other = dg.compile_model(target, drafter, dg.CompileConfig(mode="PIECEWISE", compile_workers=1, **base))
    assert pool.closed and pool not in pool_lifetime._shared_pieces
    c1, c2, c3, c4 = (e.stats()["compile"] for e in (first, second, other_options, other))
    t1, t2 = c1["compile_pool"], c2["compile_pool"]
    assert t1["workers"] == t2["workers"] == 2 and 0 <= t1["taken_s"] < t2["taken_s"]  # the same pool, taken twice
    # the first compiles every piece with kernels once (the input-checks piece is host-only: no compile)
    assert c1["pieces_reused"] == c1["compiles_reused"] == 0
    assert t1["pieces"] == c1["inductor_compiles"] == c1["unique_pieces"] - _host_only(first) >= 2
    # the second has the same unique pieces, all the first's: no compile, nothing sent to the workers
    assert c2["unique_pieces"] == c2["pieces_reused"] == c1["unique_pieces"]
    assert c2["inductor_compiles"] == t2["pieces"] == 0 and c2["compiles_reused"] == c1["inductor_compiles"]
    assert "compiled by an earlier engine" in second.warm_up_report
    # other Inductor options are another scope; other worker settings another pool: both compile their own
    assert c3["pieces_reused"] == 0 and c3["inductor_compiles"] == c1["inductor_compiles"]
    assert c4["pieces_reused"] == 0 and c4["compile_pool"]["workers"] == 1
    assert c4["inductor_compiles"] == c1["inductor_compiles"]
    assert _tokens(first) == _tokens(second) == _tokens(other_options) == _tokens(other) == ref


def _host_only(engine) -> int:
    return sum(p.host_only for p in engine.compiled.pieces.compiled.values())


def test_inputs_travel_with_their_symbols():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    with env.ignore_fresh_unbacked_symbols():
        u = env.create_unbacked_symint()
    env.constrain_symbol_range(u.node.expr, compiler_min=0, compiler_max=4096)
    with mode:
        hidden = torch.empty(u, 8)
        pair = torch.empty(2 * u, 3, dtype=torch.bfloat16)[:, 1:]  # a strided view with an offset
    data = encode_inputs([hidden, u, pair, 7, None])
    (sym,) = data["symbols"]
    assert sym["unbacked"] and (sym["min"], sym["max"]) == (0, 4096)
    _, (h2, u2, p2, seven, none) = rebuild_inputs(data)
    name = sym["name"]
    assert data["inputs"][0]["shape"] == [name, "8"] and data["inputs"][2]["shape"] == [f"2*{name}", "2"]
    assert (seven, none) == (7, None) and p2.dtype == torch.bfloat16 and p2.storage_offset() == 1
    assert p2.stride() == (3, 1) and h2.shape[1] == 8
    again = encode_inputs([h2, u2, p2, 7, None])
    assert again["inputs"] == [{**x, **_renamed(x, name, again["symbols"][0]["name"])} for x in data["inputs"]]
    with pytest.raises(NotPortable, match="object"):
        encode_inputs([object()])


def _renamed(x: dict, old: str, new: str) -> dict:
    return {k: [d.replace(old, new) for d in v] for k, v in x.items() if k in ("shape", "stride")}


def test_a_dead_worker_compiles_in_process():
    pool = CompilePool(1, "cpu", progress=False)
    try:
        os.killpg(pool.parent.pid, signal.SIGKILL)  # the workers' parent and any worker it forked
        marker = torch.nn.Identity()
        piece = pool.submit("t/submod_1/abc", None, {"nodes": [], "submodules": {}}, {"inputs": [], "symbols": []},
                            (), lambda: marker)  # fmt: skip
        pool.timeout_s = 60.0
        pool.wait_all()
        assert piece.fn is marker and pool.failures == 1 and not pool.warming
    finally:
        pool.close()


def test_a_prestarted_pool_is_taken_only_when_its_settings_match():
    from types import SimpleNamespace

    cpu = torch.device("cpu")
    first = prestart(1, "cpu")
    try:
        second = start_pool(SimpleNamespace(compile_workers=2, device=cpu), progress=False)  # other settings
        assert first.closed and second is not first and second.n == 2 and not pool_lifetime._prestarted
        second.close()
        third = prestart(1, "cpu")
        assert start_pool(SimpleNamespace(compile_workers=1, device=cpu), progress=False) is third
        third.close()
        fourth = prestart(1, "cpu")  # a build that loads artifacts compiles nothing: the pool goes
        assert start_pool(SimpleNamespace(compile_workers=1, device=cpu), wanted=False) is None and fourth.closed
        assert start_pool(SimpleNamespace(compile_workers=0, device=cpu)) is None
    finally:
        pool_lifetime.discard_prestarted()
    assert wait_stopped() == 0


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: the niceness


def test_a_held_pool_starts_its_workers_only_when_released():
    """A prestarted pool (the CLI's, before it imports torch) forks its workers but holds them (no CUDA start, no
    prewarm compile) until `release()`: the command releases it once its own imports are done, a build that takes
    it at the latest. Every process of the pool runs below the engine process's priority (compile_pool.NICE)."""
    import time

    from draftgraph.compiler.pool.compile_pool import NICE

    pool = prestart(2, "cpu")
    try:
        deadline = time.monotonic() + 120  # (a stuck start fails here, not by timing anything)
        while len(pool.workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.workers) == 2 and not pool.released
        assert not any(w.went for w in pool.workers) and all(w.ready_s is None for w in pool.workers)
        base = os.nice(0)
        assert [_nice(p) for p in (pool.parent.pid, *(w.pid for w in pool.workers))] == [min(19, base + NICE)] * 3
        taken = start_pool(SimpleNamespace(compile_workers=2, device=torch.device("cpu")), progress=False)
        assert taken is pool and pool.released and all(w.went for w in pool.workers)  # begin() released it
        pool.release()  # again: a no-op (each worker got one go)
        while any(w.ready_s is None for w in pool.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        # each worker waited for the go before its start, and said so in its phases
        assert all(w.ready_s is not None and "held" in w.phases and "prewarm" in w.phases for w in pool.workers)
        assert pool.timeline()["connected"] == 2 and "held" in pool.timeline()["phases_s"]
    finally:
        pool.close()
        pool_lifetime.discard_prestarted()
    assert wait_stopped() == 0


def test_settings():
    assert auto_workers("cpu") == 0 and 1 <= auto_workers("cuda") <= 8
    with pytest.raises(ValueError, match="compile_workers=-1 must lie in 0..64"):
        dg.CompileConfig(compile_workers=-1)


def test_pieces_differing_only_in_a_constant_do_not_share_code():
    """The cross-engine key (piecewise.engine_key) holds the values of a piece's get_attr constants, which the
    structural key names only: compiled code bakes them in."""
    from torch import fx

    from draftgraph.compiler.piecewise import engine_key
    from draftgraph.passes.split_attention import Piece, structural_key

    class Scale(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.register_buffer("c", torch.tensor([value, 2.0], dtype=torch.bfloat16))

        def forward(self, x):
            return x * self.c

    def piece(value):
        gm = fx.symbolic_trace(Scale(value))
        return Piece(0, "submod_0", False, gm, structural_key(gm))

    one, three, one_again = piece(1.0), piece(3.0), piece(1.0)
    assert one.key == three.key  # the structure alone cannot tell them apart
    assert engine_key(one) != engine_key(three) and engine_key(one) == engine_key(one_again)


def test_pieces_whose_sizes_range_differently_do_not_share_code():
    """The cross-engine key holds the value ranges of a piece's symbols (Inductor's code depends on them:
    32-bit indexing, dropped checks); the structural key renames symbols and cannot see them."""
    from torch import fx
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from draftgraph.compiler.piecewise import engine_key
    from draftgraph.passes.split_attention import Piece, structural_key

    def keys(upper: int) -> tuple[str, str]:
        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env)
        with env.ignore_fresh_unbacked_symbols():
            u = env.create_unbacked_symint()
        env.constrain_symbol_range(u.node.expr, compiler_min=0, compiler_max=upper)
        gm = fx.symbolic_trace(lambda x: x * 2)
        with mode:
            next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"] = torch.empty(u, 4)
        piece = Piece(0, "submod_0", False, gm, structural_key(gm))
        with tracing(TracingContext(mode)):
            return piece.key, engine_key(piece)

    (k_small, e_small), (k_large, e_large), (_, e_again) = keys(4096), keys(2**31), keys(4096)
    assert k_small == k_large and e_small != e_large and e_small == e_again
    assert "[0, 4096]" in e_small
