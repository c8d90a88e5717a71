"""One build path (build/): compile_model (api.py) and every worker rank (workers/) build their engine through
build/engine.py's `build_engine` from one `BuildRequest`, and the Engine is finished where it is made:
nothing outside runtime/engine.py assigns its attributes after construction."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import draftgraph
import draftgraph as dg
from draftgraph.build.request import BuildRequest
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

ROOT = Path(draftgraph.__file__).parent
ENGINE_NAMES = {"engine", "eng", "e", "probe"}  # what the package calls an Engine it holds
BELOW_BUILD = ["ops", "models", "passes", "compiler", "artifacts", "runtime"]
ABOVE_BUILD = ["api", "workers", "cli", "inspection"]


def _holds_engine(node: ast.expr) -> bool:
    """`engine`, `eng`, ... or `<anything>.engine`: an expression the package uses for an Engine."""
    return (isinstance(node, ast.Name) and node.id in ENGINE_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def engine_assignments(path: Path) -> list[str]:
    """`engine.X = ...` (also augmented or annotated), `setattr(engine, ...)`, and `runner.dispatcher = ...`
    (an engine's runner's dispatcher swapped from outside) in one file, as "line: text"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and _holds_engine(node.args[0]):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            continue
        flat = []
        for t in targets:
            flat += t.elts if isinstance(t, ast.Tuple) else [t]
        for t in flat:
            if not isinstance(t, ast.Attribute):
                continue
            swapped = t.attr == "dispatcher" and ast.unparse(t.value).endswith("runner")
            if _holds_engine(t.value) or swapped:
                found.append(f"{node.lineno}: {ast.unparse(t)} = ...")
    return found


def imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _stage(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_nothing_outside_the_engine_module_assigns_engine_attributes():
    bad = [
        f"{path.relative_to(ROOT.parent)}:{hit}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "runtime" / "engine.py"
        for hit in engine_assignments(path)
    ]
    # The runner's dispatcher is given at construction too (runtime/step.py holds it; nothing swaps it).
    bad = [b for b in bad if not b.startswith("draftgraph/runtime/step.py")]
    assert not bad, "an Engine gets everything at construction (runtime/engine.py):\n" + "\n".join(bad)


def test_the_scan_sees_an_assignment_put_back(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "def f(engine, self):\n"
        "    engine.warm_up_report = 'x'\n"
        "    self.engine.lockstep, n = None, 1\n"
        "    engine.runner.dispatcher = None\n"
        "    setattr(engine, 'tokenizer', None)\n"
        "    engine.compiled.ctx.allow_capture = True\n"  # the graph owner's own state, not the engine's
    )
    assert engine_assignments(f) == [
        "2: engine.warm_up_report = ...",
        "3: self.engine.lockstep = ...",
        "4: engine.runner.dispatcher = ...",
        "5: setattr(engine, 'tokenizer', None)",
    ]


def test_api_and_workers_build_through_build_and_build_imports_neither():
    assert "draftgraph.build.engine" in imported(ROOT / "api.py")
    worker = imported(ROOT / "workers" / "worker.py")
    assert "draftgraph.build.engine" in worker and not any(_stage(m) == "draftgraph.api" for m in worker)
    assert not (ROOT / "preflight.py").exists()  # it lives in build/ now: checks before a build loads weights
    up = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / "build").rglob("*.py"))
        for name in imported(path)
        if _stage(name) in {f"draftgraph.{s}" for s in ABOVE_BUILD}
    ]
    assert not up, "build/ sits below api / workers / cli:\n" + "\n".join(up)
    down = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for stage in BELOW_BUILD
        for path in sorted((ROOT / stage).rglob("*.py"))
        for name in imported(path)
        if _stage(name) == "draftgraph.build"
    ]
    assert not down, "runtime, artifacts and the stages below them never import build/:\n" + "\n".join(down)


def test_one_request_object_replaces_the_six_arguments():
    from draftgraph.build.engine import build_engine
    from draftgraph.workers.build import build_ranks
    from draftgraph.workers.driver import start_workers
    from draftgraph.workers.launched import join_launch
    from draftgraph.workers.worker import RankSpec, setup_rank

    for fn in (build_engine, start_workers, join_launch, setup_rank, build_ranks):
        params = inspect.signature(fn).parameters
        assert "request" in params and not {"target", "drafter", "artifacts", "tokenizer"} & set(params), fn
    assert "request" in {f.name for f in dataclasses.fields(RankSpec)}
    request = BuildRequest("ckpt")
    assert request.config == dg.CompileConfig() and request.drafter is None and request.artifacts is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.target = "other"
    with pytest.raises(TypeError, match="pass a draftgraph CompileConfig"):
        BuildRequest("ckpt", None, {"mode": "NONE"})


def test_build_compiled_takes_one_settings_object():
    from draftgraph.compiler.build import CompileSettings, build_compiled

    assert list(inspect.signature(build_compiled).parameters) == [
        "target", "drafter", "rc", "loop_fns", "settings", "pool"
    ]  # fmt: skip
    config = dg.CompileConfig(compile_backend="eager", cache_dir="/c", check_addresses=True, progress=False)
    assert CompileSettings.of(config) == CompileSettings("eager", "/c", True, "", False)


def test_compile_model_returns_a_finished_engine():
    """End to end on a tiny llama with an EAGLE drafter, compiled (PIECEWISE, eager backend: no Inductor on
    the CPU runner) and mode NONE: the engine comes back with its report, build time and no tokenizer, and
    greedy speculative decoding gives the target's own greedy tokens in both."""
    import time

    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    small = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_speculative_tokens=3)
    prompts, params = [[1, 5, 9], [7, 7, 2, 4]], dg.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = time.time()
    plain = dg.compile_model(target, None, dg.CompileConfig(mode="NONE", **small), tokenizer=False)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [len(t) for t in expected] == [8, 8]
    for mode in ("NONE", "PIECEWISE"):
        config = dg.CompileConfig(mode=mode, compile_backend="eager", progress=False, **small)
        eng = dg.compile_model(target, drafter, config, tokenizer=False)
        assert eng.tokenizer is None and eng.lockstep is None and eng.memory_plan is None  # CPU: no sizing
        assert before <= eng.build_started <= time.time()
        assert bool(eng.warm_up_report) == (mode != "NONE")  # the warm-up's line, made inside construction
        assert [o.token_ids for o in eng.generate(prompts, params)] == expected
        if mode == "PIECEWISE":
            # one trace each of the target forward and the drafter step, at warm-up (inside construction)
            assert dict(eng.compiled.counters.traces) == {"target": 1, "drafter": 1}


def test_an_engine_with_a_lockstep_gets_it_at_construction():
    """runtime/lockstep.py: the target's batches dispatch through the lock-step's dispatcher from the start;
    the drafter's keep the engine's own (they hold no collective across replicas)."""
    from draftgraph.compiler.config import resolve
    from draftgraph.runtime.engine import Engine
    from draftgraph.runtime.lockstep import Lockstep, LockstepDispatcher

    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    rc = resolve(dg.CompileConfig(mode="NONE", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64), 256, True)
    eng = Engine(target, drafter, rc, lockstep_group="replicas")
    assert isinstance(eng.lockstep, Lockstep) and eng.lockstep.group_name == "replicas"
    assert isinstance(eng.runner.dispatcher, LockstepDispatcher) and eng.lockstep.dispatcher is eng.runner.dispatcher
    assert eng.runner.proposer.dispatcher is eng.runner.dispatcher.base
    assert eng.lockstep.verify_q == eng.shapes.verify == 1 + rc.num_speculative_tokens
    plain = Engine(target, drafter, rc)
    assert plain.lockstep is None and plain.runner.proposer.dispatcher is plain.runner.dispatcher
