"""Review, then rewrite, the golden inspections under tests/golden/ (summary.json of every built-in case).

Run after a change that is meant to alter how the built-in models compile. Without --write it writes nothing:
it inspects every case afresh and prints, per case that changed, graph-diff's semantic lines (pieces, op
counts, shapes, traces, captures: draftgraph/inspection/graph_diff.py) against the committed golden, and exits 1
when any differ. Read that diff; when each change is the one intended, rerun with --write.

Usage: python scripts/refresh_goldens.py [--write] [CASE ...]   (CASE: a name such as llama-eagle-piecewise)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def review(golden: str, fresh: str) -> list[str] | None:
    """graph-diff's lines from the golden inspection directory to the fresh one, or None when they are equal.
    A new case, and a difference graph-diff has no words for, each get a line saying so (never an empty list)."""
    from draftgraph.inspection.graph_diff import diff, load

    old_path, new_path = os.path.join(golden, "summary.json"), os.path.join(fresh, "summary.json")
    if not os.path.exists(old_path):
        return ["(no golden yet: a new case)"]
    with open(old_path) as a, open(new_path) as b:
        if a.read() == b.read():
            return None
    return [c.line() for c in diff(load(golden), load(fresh))] or ["(the JSON text differs only: formatting)"]


def main(argv: list[str] | None = None) -> int:
    if ROOT not in sys.path:  # run as `python scripts/refresh_goldens.py`: tests/ imports from the repo root
        sys.path.insert(0, ROOT)
    from tests.goldens import case_name, cases, golden_dir, inspect_case

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the changed goldens (after reviewing the diff)")
    parser.add_argument("--golden-dir", default=GOLDEN, help="where the goldens live (default: tests/golden)")
    parser.add_argument("cases", nargs="*", help="case names to refresh (default: every case)")
    args = parser.parse_args(argv)
    known = {case_name(*c): c for c in cases()}
    unknown = sorted(set(args.cases) - known.keys())
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}; the cases are: {', '.join(sorted(known))}")
    warnings.simplefilter("ignore")
    changed = []
    for name in args.cases or list(known):
        family, kind, mode = known[name]
        dest = golden_dir(args.golden_dir, family, kind, mode)
        with tempfile.TemporaryDirectory() as tmp:
            inspect_case(family, kind, mode, tmp)
            lines = review(dest, tmp)
            if lines is None:
                print(f"unchanged {name}")
                continue
            changed.append(name)
            print(f"changed {name}:\n  " + "\n  ".join(lines))
            if args.write:
                os.makedirs(dest, exist_ok=True)
                shutil.copy(os.path.join(tmp, "summary.json"), os.path.join(dest, "summary.json"))
                print(f"  written {os.path.join(dest, 'summary.json')}")
    if changed and not args.write:
        print(
            f"{len(changed)} golden(s) differ; nothing written. Review the diff above; if every change is intended:"
            f"\n  python scripts/refresh_goldens.py --write {' '.join(changed)}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
