"""The `draftgraph` command: commands.py (the subcommands), parser.py (their flags), text.py (text prompts)."""

from draftgraph.cli.commands import main

__all__ = ["main"]
