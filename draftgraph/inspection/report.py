"""`draftgraph inspect`: what compiling a model pair produced, as normalized files a person and CI can diff.

For each compiled function (the target forward, the drafter step; one entry per Dynamo trace) it
records the normalized FX graph, op counts, the pieces with their splitting ops and shapes, the graph
breaks and recompiles with their source locations, and the CUDA graphs each mode captures. With depyf
installed it also writes depyf's decompiled Dynamo bytecode and compiled code under `depyf/` (raw
third-party output, not normalized).

Layout of an inspection directory:
  summary.json                   everything graph-diff compares (stable: sorted keys, no ids or paths)
  summary.txt                    the same for a person
  graphs/{fn}.trace{t}.txt       normalized whole graph after the passes
  graphs/{fn}.trace{t}.piece{i}.txt
  depyf/                         when depyf is installed
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings

import torch

from draftgraph.inspection.normalize import (
    SymbolNames,
    graph_text,
    io_shapes,
    op_counts,
    relative_location,
    target_name,
)
from draftgraph.passes.manager import PassManager

log = logging.getLogger("draftgraph")
_LOCATION = re.compile(r'File "([^"]+)", line (\d+)')


def summarize_trace(gm, split) -> tuple[dict, dict[str, str]]:
    """Summary of one trace and its normalized texts (whole graph, then each piece)."""
    syms = SymbolNames()
    texts = {"graph": graph_text(gm)}
    inputs, outputs = io_shapes(gm, syms)
    from draftgraph.compiler.piecewise import no_tensor_work

    pieces = []
    work = [p for p in split.compute_pieces if not no_tensor_work(p.graph)]  # the pieces with kernels
    for p in split.pieces:
        pin, pout = io_shapes(p.graph, syms)
        entry = {
            "index": p.index,
            "kind": _piece_kind(p, p in work),
            "ops": op_counts(p.graph),
            "inputs": pin,
            "outputs": pout,
        }
        if p.is_attention:
            entry["splitting_op"] = next(target_name(n.target) for n in p.graph.graph.nodes if n.op == "call_function")
        pieces.append(entry)
        texts[f"piece{p.index:02d}"] = graph_text(p.graph)
    summary = {
        "ops": op_counts(gm),
        "nodes": len(gm.graph.nodes),
        "inputs": inputs,
        "outputs": outputs,
        "pieces": pieces,
        "compute_pieces": len(work),
        "unique_compute_pieces": len({p.key for p in work}),
    }
    return summary, texts


def _piece_kind(piece, has_work: bool) -> str:
    """attention / boundary (the no-op split point) / checks (input size checks, no kernel) / compute."""
    if piece.is_attention:
        ops = [n.target for n in piece.graph.graph.nodes if n.op == "call_function"]
        return "boundary" if any("piece_boundary" in str(t) for t in ops) else "attention"
    return "compute" if has_work else "checks"


class RecompileLog(logging.Handler):
    """Collects Dynamo's "Recompiling function ..." messages while active."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record):
        msg = record.getMessage()
        if "Recompiling function" not in msg:
            return
        m = re.search(r"Recompiling function (\S+) in (\S+):(\d+)", msg)
        where = relative_location(m.group(2), int(m.group(3))) if m else "?"
        reasons = [_normalize_reason(line.strip(" -")) for line in msg.splitlines()[2:] if line.strip()]
        # Our entry points are named "{function}_{serial}": drop the serial, which differs run to run.
        function = re.sub(r"_\d+$", "", m.group(1)) if m else "?"
        self.records.append({"function": function, "location": where, "reasons": reasons})

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch._dynamo").removeHandler(self)
        torch._logging.set_logs()


def _normalize_reason(text: str) -> str:
    text = re.sub(r"0x[0-9a-fA-F]+", "0x?", text)
    return re.sub(r"^\d+/\d+: ", "", text)


def break_from_exception(e: Exception) -> dict:
    text = str(e)
    locations = _LOCATION.findall(text)
    where = relative_location(locations[-1][0], int(locations[-1][1])) if locations else "?"
    return {"reason": _normalize_reason(text.strip().splitlines()[0]), "location": where}


@contextlib.contextmanager
def depyf_dump(out_dir: str):
    """depyf's decompiled bytecode and compiled code under out_dir/depyf, when depyf is installed."""
    try:
        import depyf
    except ImportError:
        warnings.warn(
            "depyf is not installed: the inspection skips decompiled Dynamo bytecode "
            "(pip install 'draftgraph[inspect]')",
            stacklevel=3,
        )
        yield False
        return
    path = os.path.join(out_dir, "depyf")
    os.makedirs(path, exist_ok=True)
    with depyf.prepare_debug(path):
        yield True


def inspect_model(target, drafter, config, out_dir: str, workload=None) -> dict:
    """Compile the pair with `config` (a compiling mode), run a small workload so every traced function
    is traced, and write the inspection to out_dir. Returns the summary."""
    import draftgraph as dg

    _fresh_dir(out_dir)
    functions, texts, breaks = {}, {}, []
    with RecompileLog() as recompiles, depyf_dump(out_dir):
        try:
            engine = dg.compile_model(target, drafter, config)
            prompts, params = workload or _default_workload(engine)
            engine.generate(prompts, params)
        except torch._dynamo.exc.Unsupported as e:  # fullgraph=True: a graph break stops the compile
            breaks.append(break_from_exception(e))
            engine = None
    if engine is not None:
        backends = {"target": engine.compiled.target.backend}
        if engine.compiled.drafter is not None:
            backends["drafter"] = engine.compiled.drafter.backend
        if engine.compiled.loop_backend is not None:
            backends["draft_loop"] = engine.compiled.loop_backend
        rc = engine.config
        for name, backend in backends.items():
            traces = []
            for t, (gm, split) in enumerate(backend.traces):
                summary, trace_texts = summarize_trace(gm, split)
                summary["captures"] = captures(
                    rc, engine.k, name, summary["compute_pieces"], getattr(engine.runner, "hidden_kind", True), t
                )
                traces.append(summary)
                texts.update({f"{name}.trace{t}.{k}": v for k, v in trace_texts.items()})
            mine = [r for r in recompiles.records if r["function"].startswith(name)]
            functions[name] = {"traces": traces, "recompiles": mine, "graph_breaks": []}
        if "drafter" in functions and engine.k:
            tr = functions["drafter"]["traces"]
            functions["drafter"]["draft_loop"] = {
                "steps": engine.k,
                # PIECEWISE: every compute piece of every step is a graph launch; fused FULL: one launch
                "graph_launches_per_proposal": tr[0]["compute_pieces"] + (engine.k - 1) * tr[-1]["compute_pieces"],
                "fused": "draft_loop" in functions,
            }
    report = {"config": _config_summary(config, drafter), "functions": functions, "graph_breaks": breaks}
    write_inspection(report, texts, out_dir)
    return report


def captures(rc, k: int, fn: str, compute_pieces: int, hidden_kind: bool, trace: int = 0) -> dict:
    """The CUDA graphs a CUDA run of this config captures for one traced function, per graph kind."""
    from draftgraph.compiler.config import FULL_MODES, PIECEWISE_MODES
    from draftgraph.compiler.cuda_graphs import StepShapes

    out = {}
    shapes = StepShapes(k, hidden_kind)
    first = shapes.first_draft
    if fn == "draft_loop":  # the fused loop: FULL graphs only, one per request count and variant
        variant = ("greedy", "sample")[min(trace, 1)]
        return {"FULL": {"request_counts": list(rc.full_capture_sizes), "first_query_len": first, "variant": variant}}
    if rc.mode in PIECEWISE_MODES:
        out["PIECEWISE"] = {"sizes": list(rc.capture_sizes), "graphs": compute_pieces * len(rc.capture_sizes)}
    if rc.mode in FULL_MODES:
        # verify: 1 + K per request; a drafter's first step: 1 + K (hidden-state drafters) or K + 2 (a draft
        # model), its later steps 1; without a drafter, plain decode: 1
        later = shapes.later_draft
        drafter_qs = [later] if rc.fuse_draft_loop else [first, later]  # fused: the first step lives in the loop
        qs = ([shapes.verify] if fn == "target" else drafter_qs) if k else [later]
        out["FULL"] = {"request_counts": list(rc.full_capture_sizes), "query_lens": qs}
    return out


def inspect_function(name: str, fn, args: tuple, out_dir: str) -> dict:
    """Inspect any function (toy models, user code): Dynamo's graphs and breaks via explain, each graph
    through our passes and split."""
    _fresh_dir(out_dir)
    torch._dynamo.reset()
    with RecompileLog() as recompiles:
        explanation = torch._dynamo.explain(fn)(*args)
    breaks = []
    for br in explanation.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = relative_location(frame.filename, frame.lineno) if frame else "?"
        breaks.append({"reason": _normalize_reason(br.reason.strip().splitlines()[0]), "location": where})
    traces, texts = [], {}
    for t, gm in enumerate(explanation.graphs):
        summary, trace_texts = summarize_trace(gm, PassManager().run(gm, name))
        traces.append(summary)
        texts.update({f"{name}.trace{t}.{k}": v for k, v in trace_texts.items()})
    report = {
        "config": {"function": name},
        "functions": {name: {"traces": traces, "graph_breaks": breaks, "recompiles": recompiles.records}},
        "graph_breaks": breaks,
    }
    write_inspection(report, texts, out_dir)
    return report


def write_inspection(report: dict, texts: dict[str, str], out_dir: str) -> None:
    os.makedirs(os.path.join(out_dir, "graphs"), exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        f.write(json.dumps(report, indent=1, sort_keys=True) + "\n")
    for key, text in sorted(texts.items()):
        with open(os.path.join(out_dir, "graphs", f"{key}.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary_text(report))


def summary_text(report: dict) -> str:
    lines = [f"config: {json.dumps(report['config'], sort_keys=True)}"]
    for br in report.get("graph_breaks", []):
        lines.append(f"GRAPH BREAK at {br['location']}: {br['reason']}")
    for name, fn in sorted(report["functions"].items()):
        lines.append(f"\n{name}: {len(fn['traces'])} trace(s), {len(fn.get('recompiles', []))} recompile(s)")
        for r in fn.get("recompiles", []):
            lines.append(f"  recompile at {r['location']}: {'; '.join(r['reasons'])}")
        for t, tr in enumerate(fn["traces"]):
            lines.append(
                f"  trace {t}: {tr['nodes']} nodes, {len(tr['pieces'])} pieces "
                f"({tr['compute_pieces']} compute, {tr['unique_compute_pieces']} unique)"
            )
            for p in tr["pieces"]:
                what = p.get("splitting_op", f"{sum(p['ops'].values())} ops")
                lines.append(f"    piece {p['index']:2d} {p['kind']:9s} {what}; out {', '.join(p['outputs'])}")
            for kind, cap in sorted(tr.get("captures", {}).items()):
                if name == "draft_loop":
                    lines.append(f"    FULL ({cap['variant']}): request counts {cap['request_counts']}")
                elif kind == "FULL":
                    lines.append(
                        f"    FULL: whole-forward graphs for query lengths {cap['query_lens']} x request "
                        f"counts {cap['request_counts']}"
                    )
                else:
                    lines.append(f"    {kind}: {cap['graphs']} piece graphs at token counts {cap['sizes']}")
        if "draft_loop" in fn:
            dl = fn["draft_loop"]
            fused = "; fused into one FULL graph for uniform batches" if dl.get("fused") else ""
            lines.append(
                f"  draft loop: {dl['steps']} steps, {dl['graph_launches_per_proposal']} piece graph launches{fused}"
            )
    return "\n".join(lines) + "\n"


def _config_summary(config, drafter) -> dict:
    kind = getattr(drafter, "kind", None) if drafter is not None and not isinstance(drafter, str) else drafter
    return {
        "mode": config.mode,
        "num_speculative_tokens": config.num_speculative_tokens,
        "capture_sizes": list(config.capture_sizes),
        "drafter": kind,
    }


def _default_workload(engine):
    import draftgraph as dg

    prompts = [[1, 2, 3], [4] * 11, [5, 6]]
    return prompts, dg.SamplingParams(max_tokens=6, ignore_eos=True)


def _fresh_dir(path: str) -> None:
    if os.path.isdir(path):
        for name in ("graphs", "depyf"):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    os.makedirs(path, exist_ok=True)
