"""Where the project's assets live and where built models are cached."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = Path(os.environ.get("OMNI_STUDIO_ASSETS", REPO_ROOT / "assets"))
MODEL_RECIPES_DIR = ASSETS_DIR / "models"
DEPLOY_PRESETS_DIR = ASSETS_DIR / "deploy"


def default_data_dir() -> Path:
    """``$OMNI_STUDIO_DATA_DIR``, else ``$XDG_DATA_HOME/omni-studio`` (``~/.local/share/omni-studio``)."""
    if os.environ.get("OMNI_STUDIO_DATA_DIR"):
        return Path(os.environ["OMNI_STUDIO_DATA_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "omni-studio"


def model_cache_dir(data_dir: Path) -> Path:
    """Built-in models are built once into ``<data_dir>/models`` (``$OMNI_STUDIO_MODEL_CACHE`` overrides)."""
    if os.environ.get("OMNI_STUDIO_MODEL_CACHE"):
        return Path(os.environ["OMNI_STUDIO_MODEL_CACHE"]).expanduser()
    return Path(data_dir) / "models"
