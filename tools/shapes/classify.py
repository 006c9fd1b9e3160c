"""A pixel classifier for pictures of the shapes world: what does a generated image show?

- background: the palette entry nearest to most pixels;
- shape colour: the palette entry nearest to most of the other pixels;
- position: the centroid of the shape-coloured pixels, nearest of the five positions' centroids;
- shape: the template (circle, square, triangle, moved to that centroid) overlapping the
  shape-coloured pixels best (intersection over union).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tools.shapes.world import (
    COLOUR_NAMES,
    POSITIONS,
    SHAPES,
    SIZE,
    Scene,
    dominant_colours,
    shape_mask,
)

ATTRIBUTES = ("shape", "colour", "background", "position")
MIN_SHAPE_PIXELS = 200  # fewer shape-coloured pixels than this: no shape drawn


@dataclass(frozen=True)
class Reading:
    """What the classifier sees in an image (``shape``/``position`` None when there is no shape)."""

    shape: str | None
    colour: str
    background: str
    position: str | None
    iou: float

    def correct(self, scene: Scene) -> dict[str, bool]:
        """Per attribute: does the image show what ``scene`` asks for?"""
        return {a: getattr(self, a) == getattr(scene, a) for a in ATTRIBUTES}


@lru_cache(maxsize=1)
def _templates() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each shape's mask drawn at the image centre, and its centroid offset from the box centre."""
    out = {}
    for shape in SHAPES:
        mask = shape_mask(shape, (SIZE / 2, SIZE / 2))
        ys, xs = np.nonzero(mask)
        out[shape] = (mask, np.array([xs.mean() + 0.5 - SIZE / 2, ys.mean() + 0.5 - SIZE / 2]))
    return out


def _shift(mask: np.ndarray, dx: int, dy: int) -> np.ndarray:
    out = np.zeros_like(mask)
    h, w = mask.shape
    ys, xs = slice(max(dy, 0), h + min(dy, 0)), slice(max(dx, 0), w + min(dx, 0))
    src_y, src_x = slice(max(-dy, 0), h + min(-dy, 0)), slice(max(-dx, 0), w + min(-dx, 0))
    out[ys, xs] = mask[src_y, src_x]
    return out


def classify(image: np.ndarray) -> Reading:
    """Read a (128, 128, 3) uint8 RGB image."""
    idx, background, colour = dominant_colours(np.asarray(image)[..., :3])
    fg = idx == colour
    if fg.sum() < MIN_SHAPE_PIXELS:
        return Reading(None, COLOUR_NAMES[colour], COLOUR_NAMES[background], None, 0.0)
    ys, xs = np.nonzero(fg)
    centroid = np.array([xs.mean() + 0.5, ys.mean() + 0.5])
    templates = _templates()
    best_shape, best_iou = None, -1.0
    for shape, (template, offset) in templates.items():
        box_centre = centroid - offset
        moved = _shift(template, int(round(box_centre[0] - SIZE / 2)), int(round(box_centre[1] - SIZE / 2)))
        iou = float((moved & fg).sum() / max((moved | fg).sum(), 1))
        if iou > best_iou:
            best_shape, best_iou = shape, iou
    position = min(
        POSITIONS,
        key=lambda p: float(np.linalg.norm(centroid - (np.array(POSITIONS[p]) + templates[best_shape][1]))),
    )
    return Reading(best_shape, COLOUR_NAMES[colour], COLOUR_NAMES[background], position, best_iou)
