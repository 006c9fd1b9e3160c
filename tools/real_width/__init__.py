"""A GLM-Image at the released model's widths (stacks cut to a layer or two, random weights), in the
real checkpoint layout: ``.venv/bin/python -m tools.real_width OUT_DIR``. docs/real-shapes.md."""

from tools.real_width.builder import (
    RealWidthConfigs,
    build,
    cut_configs,
    ensure_built,
    released_configs,
)

__all__ = ["RealWidthConfigs", "build", "cut_configs", "ensure_built", "released_configs"]
