"""`draftgraph graph-diff A B`: a semantic diff of two inspections (summary.json files).

Reports functions added or removed, traces (recompiles) gained or lost, new or fixed graph breaks, pieces
added or removed, op-count changes per piece, input/output shape changes, a change in how many graph
launches the draft loop needs, and changes in what each mode captures. Exit status: 0 equal, 1
different, 2 error (a directory without summary.json, unreadable input).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Change:
    kind: str  # function, trace, graph_break, recompile, pieces, ops, shapes, draft_loop, captures
    where: str
    detail: str

    def line(self) -> str:
        return f"[{self.kind}] {self.where}: {self.detail}"


class InspectionError(Exception):
    pass


def load(path: str) -> dict:
    summary = os.path.join(path, "summary.json") if os.path.isdir(path) else path
    if not os.path.exists(summary):
        raise InspectionError(f"{path!r} is not an inspection: no summary.json there (run `draftgraph inspect`)")
    try:
        with open(summary) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InspectionError(f"cannot read {summary!r}: {e}") from e


def diff(a: dict, b: dict) -> list[Change]:
    changes = []
    _set_diff(changes, "graph_break", "model", _breaks(a.get("graph_breaks", [])), _breaks(b.get("graph_breaks", [])))
    fa, fb = a.get("functions", {}), b.get("functions", {})
    for name in sorted(fa.keys() - fb.keys()):
        changes.append(Change("function", name, "removed"))
    for name in sorted(fb.keys() - fa.keys()):
        changes.append(Change("function", name, "added"))
    for name in sorted(fa.keys() & fb.keys()):
        _diff_function(changes, name, fa[name], fb[name])
    if not changes and a != b:
        paths = json_paths(a, b)
        changes.append(
            Change(
                "summary",
                "summary.json",
                f"differs at {', '.join(paths[:5])}" + (f" and {len(paths) - 5} more" if len(paths) > 5 else ""),
            )
        )
    return changes


def json_paths(a, b, path="") -> list[str]:
    """Paths where two JSON values differ (the diff's last resort: nothing goes unreported)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(a.keys() | b.keys()) for p in json_paths(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in json_paths(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "."]


def _breaks(items) -> set[str]:
    return {f"{x['location']}: {x['reason']}" for x in items}


def _set_diff(changes, kind, where, old: set, new: set) -> None:
    for x in sorted(new - old):
        changes.append(Change(kind, where, f"new: {x}"))
    for x in sorted(old - new):
        changes.append(Change(kind, where, f"gone: {x}"))


def _diff_function(changes, name, a, b) -> None:
    _set_diff(changes, "graph_break", name, _breaks(a.get("graph_breaks", [])), _breaks(b.get("graph_breaks", [])))
    ra = {f"{r['location']}: {'; '.join(r['reasons'])}" for r in a.get("recompiles", [])}
    rb = {f"{r['location']}: {'; '.join(r['reasons'])}" for r in b.get("recompiles", [])}
    _set_diff(changes, "recompile", name, ra, rb)
    ta, tb = a["traces"], b["traces"]
    if len(ta) != len(tb):
        changes.append(Change("trace", name, f"traces {len(ta)} -> {len(tb)}"))
    for t, (x, y) in enumerate(zip(ta, tb)):
        _diff_trace(changes, f"{name} trace {t}", x, y)
    if a.get("draft_loop") != b.get("draft_loop"):
        da, db = a.get("draft_loop") or {}, b.get("draft_loop") or {}
        changes.append(
            Change(
                "draft_loop",
                name,
                f"graph launches per proposal "
                f"{da.get('graph_launches_per_proposal')} -> {db.get('graph_launches_per_proposal')}, "
                f"steps {da.get('steps')} -> {db.get('steps')}",
            )
        )


def _diff_trace(changes, where, a, b) -> None:
    pa, pb = a["pieces"], b["pieces"]
    if len(pa) != len(pb) or a["compute_pieces"] != b["compute_pieces"]:
        changes.append(
            Change(
                "pieces",
                where,
                f"pieces {len(pa)} -> {len(pb)} (compute {a['compute_pieces']} -> "
                f"{b['compute_pieces']}, unique {a['unique_compute_pieces']} -> "
                f"{b['unique_compute_pieces']})",
            )
        )
    elif a["unique_compute_pieces"] != b["unique_compute_pieces"]:
        changes.append(
            Change(
                "pieces", where, f"unique compute pieces {a['unique_compute_pieces']} -> {b['unique_compute_pieces']}"
            )
        )
    _diff_ops(changes, f"{where} (whole graph)", a["ops"], b["ops"])
    for x, y in zip(pa, pb):
        pw = f"{where} piece {x['index']}"
        if x["kind"] != y["kind"]:
            changes.append(Change("pieces", pw, f"{x['kind']} -> {y['kind']}"))
        _diff_ops(changes, pw, x["ops"], y["ops"])
        for io in ("inputs", "outputs"):
            if x[io] != y[io]:
                changes.append(Change("shapes", pw, f"{io} {_short(x[io])} -> {_short(y[io])}"))
    if a.get("inputs") != b.get("inputs") or a.get("outputs") != b.get("outputs"):
        changes.append(
            Change("shapes", where, f"graph inputs/outputs {_short(a.get('outputs'))} -> {_short(b.get('outputs'))}")
        )
    if a.get("captures") != b.get("captures"):
        changes.append(Change("captures", where, f"{a.get('captures')} -> {b.get('captures')}"))


def _diff_ops(changes, where, a: dict, b: dict) -> None:
    deltas = [(op, b.get(op, 0) - a.get(op, 0)) for op in sorted(a.keys() | b.keys())]
    deltas = [f"{op} {d:+d}" for op, d in deltas if d]
    if deltas:
        changes.append(Change("ops", where, ", ".join(deltas)))


def _short(items) -> str:
    items = items or []
    text = ", ".join(items)
    return text if len(text) < 120 else text[:117] + "..."


def main_diff(a_path: str, b_path: str, as_json: bool) -> int:
    try:
        changes = diff(load(a_path), load(b_path))
    except InspectionError as e:
        print(f"draftgraph graph-diff: error: {e}")
        return 2
    if as_json:
        print(json.dumps({"equal": not changes, "changes": [asdict(c) for c in changes]}, indent=1))
    elif changes:
        print(f"{len(changes)} change(s) from {a_path} to {b_path}:")
        for c in changes:
            print("  " + c.line())
    else:
        print(f"no change: {a_path} and {b_path} compile the same way")
    return 1 if changes else 0
