"""Omni Studio: the web studio, the OpenAI-compatible API, the run store and the CLI around ``engine``.

One package per concern (docs/ARCHITECTURE.md has the owner table): ``api``, ``ui`` and ``cli`` are the
three ways in; ``runs`` is the one run path they share; ``jobs``, ``recipes`` and ``replay`` are features
built on it; ``store`` records every run; ``media`` encodes outputs; ``startup`` starts the process.
``controller`` (``Studio``: the engine, the serving state and the store of the running process) and
``errors`` (how commands stop on purpose) are used across all of them, so they stay at the top.
"""

__version__ = "0.1.0"
