"""The synthetic shapes world: rendering, captions, the held-out split and the code quantiser.

A 128x128 picture holds one shape (circle, square, triangle) about 56 px across, of one palette colour,
on a plain background of another, at one of five positions: 3 x 6 x 5 x 5 = 450 combinations, each
drawn exactly one way (the caption decides every pixel).

The quantiser is a fixed function of the pixels that gives the AR model its two grids:

- preview (16x16, one code per 8 px cell): is the cell mostly shape or mostly background? Two codes.
  The preview only has to tell the target where the shape is; colour-free, it is the same for all
  30 colour pairs of a shape at a position, so no held-out colour pair can make it unfamiliar.
- target (4x4, one code per 32 px cell): the image's (shape colour, background colour) pair and the
  cell's 2x2 sub-cell mask (which 16 px quarter is mostly shape): 30 pairs x 16 masks = 480 codes.
  The DiT sees these (upsampled 2x, one per 16 px token), so it can read colours, position and
  outline (a square fills its 4x4 sub-cells, a circle misses the corners, a triangle is a pyramid).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SIZE = 128
SHAPE_SIZE = 56
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 40),
    "purple": (150, 50, 200),
    "cyan": (40, 210, 220),
}
COLOUR_NAMES = tuple(COLOURS)
PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)
SHAPES = ("circle", "square", "triangle")
# Centre (x, y) of the shape's bounding box.
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (32, 32),
    "top right": (96, 32),
    "bottom left": (32, 96),
    "bottom right": (96, 96),
    "center": (64, 64),
}
POSITION_NAMES = tuple(POSITIONS)

PREVIEW_SIDE, TARGET_SIDE = 16, 4  # the AR grids of a 128x128 T2I request (engine.processors.grid_layout)
COLOUR_PAIRS = tuple((f, b) for f in range(len(COLOURS)) for b in range(len(COLOURS)) if f != b)
MASKS = 16  # 2x2 sub-cells, one bit each
TARGET_CODES = len(COLOUR_PAIRS) * MASKS  # 480: ids 0..479
PREVIEW_BACKGROUND, PREVIEW_SHAPE = TARGET_CODES, TARGET_CODES + 1  # 480, 481
VISION_CODES = TARGET_CODES + 2  # 482 image codes; image start/end follow (482, 483)


@dataclass(frozen=True)
class Scene:
    """One combination of the world."""

    shape: str
    colour: str
    background: str
    position: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background, {self.position}"

    @property
    def held_out(self) -> bool:
        """Fixed split: every pair of attribute values still appears in training (12 of 15 per pair)."""
        s = SHAPES.index(self.shape)
        f, b = COLOUR_NAMES.index(self.colour), COLOUR_NAMES.index(self.background)
        p = POSITION_NAMES.index(self.position)
        return (s + f + b + p) % 5 == 0


def all_scenes() -> list[Scene]:
    """The 450 combinations in a fixed order."""
    return [
        Scene(shape, colour, background, position)
        for shape, colour, background, position in itertools.product(
            SHAPES, COLOUR_NAMES, COLOUR_NAMES, POSITION_NAMES
        )
        if colour != background
    ]


def training_scenes() -> list[Scene]:
    return [s for s in all_scenes() if not s.held_out]


def held_out_scenes() -> list[Scene]:
    return [s for s in all_scenes() if s.held_out]


@lru_cache(maxsize=1)
def _scenes_by_caption() -> dict[str, Scene]:
    return {scene.caption: scene for scene in all_scenes()}


def parse_caption(caption: str) -> Scene | None:
    """The scene a caption names (None if it is not one of the world's captions)."""
    return _scenes_by_caption().get(caption.strip())


def shape_mask(
    shape: str, centre: tuple[float, float], size: int = SIZE, shape_size: float = SHAPE_SIZE
) -> np.ndarray:
    """Boolean (size, size) mask of ``shape`` whose bounding box is centred at ``centre`` (x, y)."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5  # pixel centres
    cx, cy = centre
    half = shape_size / 2
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= half * half
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "triangle":  # apex up, base at the bottom of the box
        t = (dy + half) / shape_size  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= half * t)
    raise ValueError(f"unknown shape {shape!r}")


def render(
    scene: Scene, offset: tuple[float, float] = (0.0, 0.0), shape_size: float = SHAPE_SIZE
) -> np.ndarray:
    """The scene as a (128, 128, 3) uint8 RGB array (``offset``/``shape_size``: a jittered variant)."""
    cx, cy = POSITIONS[scene.position]
    image = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    image[:] = COLOURS[scene.background]
    image[shape_mask(scene.shape, (cx + offset[0], cy + offset[1]), shape_size=shape_size)] = COLOURS[
        scene.colour
    ]
    return image


def palette_indices(image: np.ndarray) -> np.ndarray:
    """Nearest palette entry of every pixel: (H, W) ints."""
    pixels = image.reshape(-1, 1, 3).astype(np.float32)
    distances = ((pixels - PALETTE[None]) ** 2).sum(-1)
    return distances.argmin(-1).reshape(image.shape[:2])


def _block_means(mask: np.ndarray, cell: int) -> np.ndarray:
    h, w = mask.shape
    return mask.reshape(h // cell, cell, w // cell, cell).mean(axis=(1, 3))


@dataclass(frozen=True)
class Codes:
    preview: np.ndarray  # (16, 16) ids
    target: np.ndarray  # (4, 4) ids


def dominant_colours(image: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Palette index of every pixel of a 128x128 RGB image, the background (the commonest colour) and the
    shape colour (the next; a blank image gets the first other colour)."""
    if image.shape != (SIZE, SIZE, 3):
        raise ValueError(f"expected a {SIZE}x{SIZE} RGB image, got shape {image.shape}")
    idx = palette_indices(image)
    counts = np.bincount(idx.reshape(-1), minlength=len(PALETTE))
    background = int(counts.argmax())
    counts[background] = -1
    return idx, background, int(counts.argmax())


def quantise(image: np.ndarray) -> Codes:
    """The AR's preview and target codes of a 128x128 RGB image (a fixed, deterministic function)."""
    idx, background, colour = dominant_colours(image)
    fg = (idx != background).astype(np.float32)
    preview = np.where(_block_means(fg, SIZE // PREVIEW_SIDE) > 0.5, PREVIEW_SHAPE, PREVIEW_BACKGROUND)
    quarters = _block_means(fg, SIZE // TARGET_SIDE // 2) > 0.5  # (8, 8) bits
    bits = (
        quarters.reshape(TARGET_SIDE, 2, TARGET_SIDE, 2)
        .transpose(0, 2, 1, 3)
        .reshape(TARGET_SIDE, TARGET_SIDE, 4)
    )
    masks = (bits * np.array([1, 2, 4, 8])).sum(-1)
    pair = COLOUR_PAIRS.index((colour, background))
    return Codes(preview=preview.astype(np.int64), target=(pair * MASKS + masks).astype(np.int64))
