"""Process-wide settings for the model libraries: offline, quiet, no progress bars of their own."""

from __future__ import annotations

import gc


def quiet_libraries() -> None:
    """Keep the terminal for our own progress: no library progress bars, warnings only when they matter."""
    import os
    import sys

    # HF_HUB_OFFLINE is the user's: a hub id not in the cache downloads unless it is set (engine/hub.py).
    # Every model load reads a local folder (a built-in model's, the user's, or a resolved snapshot).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Environment first: commands that never load a model (history, validate) stay free of the import.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    if "diffusers" in sys.modules:
        diffusers = sys.modules["diffusers"]
        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()


class StartupCollection:
    """No cyclic garbage collection while a process starts; ``done()`` (or leaving the ``with``) turns it
    back on.

    Start-up builds about a million long-lived objects (modules, classes, the model) and almost no garbage,
    yet the collector walks all of them again and again as they pile up: importing torch, transformers,
    diffusers and gradio takes ~20% less time with it off (docs/batching.md, "Start-up"). With
    ``freeze=True`` (long-lived servers) ``done()`` also moves everything alive into the permanent
    generation, so that no later full collection walks those objects again: one such walk takes ~0.7 s
    here, a pause every request in flight would feel. The price: the few MB of cyclic garbage made during
    start-up are never freed (measured: ~30,000 blocks, ~13 MB). Not nested: ``done()`` turns it on.
    """

    def __init__(self, freeze: bool = False) -> None:
        self.freeze = freeze
        self.settled = False

    def __enter__(self) -> StartupCollection:
        gc.disable()
        return self

    def done(self) -> None:
        if self.settled:
            return
        self.settled = True
        if self.freeze:
            gc.freeze()
        gc.enable()

    def __exit__(self, *exc_info: object) -> None:
        self.done()
