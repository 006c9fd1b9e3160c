"""The command line, ``omni-studio``: one module per command family.

``commands`` holds the parser, :func:`main` (the console entry point, ``python -m studio.cli``) and the
small commands (``ui``, ``serve``, ``run``, ``validate``, ``history``); ``batch``, ``replay`` and
``recipe`` are the commands of those features; ``progress`` draws a run's terminal progress bars.
"""

from studio.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
