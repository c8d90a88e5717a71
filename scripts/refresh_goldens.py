"""Rewrite the golden inspections under tests/golden/ (summary.json of every built-in case).

Run after a change that is meant to alter how the built-in models compile; review `git diff tests/golden`.
Usage: python scripts/refresh_goldens.py
"""

import os
import shutil
import sys
import tempfile
import warnings

from tests.goldens import case_name, cases, golden_dir, inspect_case


def main() -> int:
    root = os.path.join(os.path.dirname(__file__), "..", "tests", "golden")
    os.makedirs(root, exist_ok=True)
    warnings.simplefilter("ignore")
    for family, kind, mode in cases():
        with tempfile.TemporaryDirectory() as tmp:
            inspect_case(family, kind, mode, tmp)
            dest = golden_dir(root, family, kind, mode)
            os.makedirs(dest, exist_ok=True)
            shutil.copy(os.path.join(tmp, "summary.json"), os.path.join(dest, "summary.json"))
        print(f"refreshed {case_name(family, kind, mode)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
