"""`draftgraph build` with several ranks: every rank compiles its share and writes its own artifact set into
OUT/rank-R (artifacts/ranks.py), whether draftgraph starts the ranks (driver.py) or torchrun did
(launched.py)."""

from __future__ import annotations

from typing import Any

from draftgraph.compiler.config import CompileConfig


def build_ranks(target: Any, drafter: Any, config: CompileConfig, out: str) -> list[dict]:
    """Build tensor_parallel_size x data_parallel_size ranks' engines, each writing out/rank-R; every rank's
    manifest, by rank. The ranks are stopped before it returns."""
    from draftgraph.workers.driver import start_workers
    from draftgraph.workers.launched import join_launch, uses_launch

    launch = uses_launch(config)
    if launch is not None:
        engine = join_launch(launch, target, drafter, config, tokenizer=False, build_dir=out)
    else:
        engine = start_workers(target, drafter, config, tokenizer=False, build_dir=out)
    try:
        return [info["manifest"] for info in engine.rank_info]
    finally:
        engine.close()
