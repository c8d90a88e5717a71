"""`draftgraph build` with several ranks: every rank compiles its share and writes its own artifact set into
OUT/rank-R (artifacts/ranks.py), whether draftgraph starts the ranks (driver.py) or torchrun did
(launched.py)."""

from __future__ import annotations

from dataclasses import replace

from draftgraph.build.request import BuildRequest


def build_ranks(request: BuildRequest, out: str) -> list[dict]:
    """Build tensor_parallel_size x data_parallel_size ranks' engines from `request`, each writing out/rank-R;
    every rank's manifest, by rank. The ranks are stopped before it returns."""
    from draftgraph.workers.driver import start_workers
    from draftgraph.workers.launched import join_launch, uses_launch

    request = replace(request, tokenizer=False, build_dir=out)
    launch = uses_launch(request.config)
    engine = join_launch(launch, request) if launch is not None else start_workers(request)
    try:
        return [info["manifest"] for info in engine.rank_info]
    finally:
        engine.close()
