"""Process-wide settings for the model libraries: offline, quiet, no progress bars of their own."""

from __future__ import annotations


def quiet_libraries() -> None:
    """Keep the terminal for our own progress: no library progress bars, warnings only when they matter."""
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
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
