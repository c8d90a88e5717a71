"""The debugging environment variables, all in one place; each has a CLI flag and a CompileConfig twin.

DRAFTGRAPH_CHECK_ADDRESSES=1   --check-addresses   CompileConfig.check_addresses: verify static input addresses
                                                   at every graph replay
DRAFTGRAPH_DUMP_GRAPHS=DIR     --dump-graphs DIR   CompileConfig.dump_graphs_dir: write each pass's before/after
                                                   graph to DIR

They only set the CLI flags' defaults (cli/parser.py). Choices that change a traced graph or a kernel are not
environment variables: they are CompileConfig fields resolved into ResolvedConfig (CompileConfig.ops, an
OpChoices: ops/choices.py; `--ops gemv=0,...` on the command line), so an artifact's manifest records them.
"""

from __future__ import annotations

import os


def check_addresses() -> bool:
    return os.environ.get("DRAFTGRAPH_CHECK_ADDRESSES", "0") == "1"


def dump_graphs_dir() -> str:
    return os.environ.get("DRAFTGRAPH_DUMP_GRAPHS", "")
