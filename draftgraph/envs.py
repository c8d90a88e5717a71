"""The debugging environment variables, all in one place; each has a CLI flag twin.

DRAFTGRAPH_CHECK_ADDRESSES=1   --check-addresses   verify static input addresses at every graph replay
DRAFTGRAPH_DUMP_GRAPHS=DIR     --dump-graphs DIR   write each pass's before/after graph to DIR
"""

from __future__ import annotations

import os


def check_addresses() -> bool:
    return os.environ.get("DRAFTGRAPH_CHECK_ADDRESSES", "0") == "1"


def dump_graphs_dir() -> str:
    return os.environ.get("DRAFTGRAPH_DUMP_GRAPHS", "")
