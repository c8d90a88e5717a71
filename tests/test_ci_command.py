"""CI runs exactly the README's test command (.ci/run), and that command lints before it tests."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_ci_runs_the_readme_test_command_ruff_first():
    blocks = re.findall(r"```bash\n(.*?)```", _read("README.md"), flags=re.S)
    commands = [[ln for ln in b.splitlines() if ln and not ln.startswith("#")] for b in blocks[:2]]
    assert [len(c) for c in commands] == [1, 1], commands  # the two opening commands, one line each
    generate, test = commands[0][0], commands[1][0]
    assert generate.endswith("draftgraph generate")
    ci = [ln for ln in _read(".ci", "run").splitlines() if ln.startswith("pip install")]
    assert ci == [test]  # exactly the README's test command
    steps = [s.strip() for s in test.split("&&")]
    assert steps[-3:] == ["ruff check .", "ruff format --check .", "python -m pytest tests -q -n 2 --dist loadfile"]
    pyproject = _read("pyproject.toml")  # (no tomllib on 3.10)
    extra = re.search(r"^test = \[(.*?)\]$", pyproject, flags=re.M | re.S).group(1)
    assert re.search(r'"ruff[<>=][^"]*"', extra), extra  # `pip install -e ".[test]"` brings ruff
    assert re.search(r'"pytest-xdist[<>=][^"]*"', extra), extra  # and pytest-xdist, for `-n 2`
