"""The command line, ``omni-studio``: one module per command family.

``commands`` holds :func:`main` (the console entry point, ``python -m studio.cli``) and the table of
commands; ``parser`` every command's flags and the settings built from them; ``run``, ``validate``,
``history``, ``batch``, ``replay`` and ``recipe`` one command (family) each; ``progress`` draws a run's
terminal progress bars.
"""

from studio.cli.commands import main
from studio.cli.parser import build_parser

__all__ = ["build_parser", "main"]
