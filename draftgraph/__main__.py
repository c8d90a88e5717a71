from draftgraph.cli import run

run()
