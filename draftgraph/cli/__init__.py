"""The `draftgraph` command: commands.py (the subcommands), parser.py (their flags), text.py (text prompts)."""

from draftgraph.cli.commands import main, run

__all__ = ["main", "run"]
