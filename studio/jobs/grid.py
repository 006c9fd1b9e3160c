"""A finished job's labelled grid (Pillow): X values across, Y values (and prompts, seeds) down.

Layout (docs/jobs.md, "The grid"): the columns are the X values, or the seeds when there is no X axis
and several seeds; the rows are every combination of what else varies, in this order: the prompt, the
seed (when not the columns), the Y value. What does not vary (one prompt, one seed) goes in the title.
Cells smaller than 128 px are scaled up by a whole factor (nearest neighbour: the pixels stay the
model's), and a cell without an image (failed, cancelled) shows why. Same job, same images -> same bytes.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from studio.jobs.spec import JobSpec, value_label

MIN_CELL = 128
GAP = 6
MARGIN = 12
FONT_SIZE = 14
TITLE_SIZE = 16
LABEL_CHARS = 28  # row labels wrap at this many characters
MAX_LABEL_LINES = 4
BACKGROUND = (255, 255, 255)
INK = (40, 40, 48)
MUTED = (120, 120, 130)
EMPTY = (236, 236, 240)


@dataclass(frozen=True)
class GridLayout:
    """Where each cell goes: ``places[item index] = (row, column)``, with the labels of both."""

    title: str
    columns: list[str]
    rows: list[str]
    places: dict[int, tuple[int, int]]


def _prompt_label(prompt: str) -> str:
    return prompt if len(prompt) <= 80 else prompt[:77] + "..."


def grid_layout(spec: JobSpec, title: str) -> GridLayout:
    """The grid of ``spec``'s cells (see the module docstring for the rules)."""
    seeds = spec.seeds or [0]
    y_values = spec.y.values if spec.y else [None]
    seed_columns = spec.x is None and len(seeds) > 1
    if spec.x is not None:
        columns = [value_label(spec.x.param, v, i) for i, v in enumerate(spec.x.values)]
    elif seed_columns:
        columns = [f"seed {seed}" for seed in seeds]
    else:
        columns = [""]
    # Row dimensions: (labels of each value) for each thing that varies down the grid.
    dimensions: list[list[str]] = []
    if len(spec.prompts) > 1:
        dimensions.append([_prompt_label(p) for p in spec.prompts])
    if len(seeds) > 1 and not seed_columns:
        dimensions.append([f"seed {seed}" for seed in seeds])
    if spec.y is not None:
        dimensions.append([value_label(spec.y.param, v, i) for i, v in enumerate(spec.y.values)])
    rows = [""]
    for labels in dimensions:
        rows = [f"{row}\n{label}".strip("\n") for row in rows for label in labels]
    fixed = [title]
    if len(spec.prompts) == 1:
        fixed.append(_prompt_label(spec.prompts[0]))
    if len(seeds) == 1:
        fixed.append(f"seed {seeds[0]}")
    places: dict[int, tuple[int, int]] = {}
    for cell in spec.cells():
        s = seeds.index(cell.seed)
        x = cell.x or 0
        y = cell.y or 0
        column = x if spec.x is not None else (s if seed_columns else 0)
        row = 0
        if len(spec.prompts) > 1:
            row = cell.prompt_index
        if len(seeds) > 1 and not seed_columns:
            row = row * len(seeds) + s
        if spec.y is not None:
            row = row * len(y_values) + y
        places[cell.index] = (row, column)
    return GridLayout(" · ".join(fixed), columns, rows, places)


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _wrap(label: str) -> list[str]:
    lines: list[str] = []
    for part in label.split("\n"):
        lines += textwrap.wrap(part, LABEL_CHARS) or [""]
    if len(lines) > MAX_LABEL_LINES:
        lines = lines[: MAX_LABEL_LINES - 1] + [lines[MAX_LABEL_LINES - 1][: LABEL_CHARS - 3] + "..."]
    return lines


def _text_width(
    draw: ImageDraw.ImageDraw, text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont
) -> int:
    left, _, right, _ = draw.textbbox((0, 0), text, font=font)
    return int(right - left)


def compose_grid(
    layout: GridLayout,
    images: Mapping[int, Image.Image],
    notes: Mapping[int, str] | None = None,
    cell_size: tuple[int, int] | None = None,
) -> Image.Image:
    """The grid image: ``images[item index]`` at its place, ``notes[item index]`` where there is no image."""
    notes = notes or {}
    if cell_size is None:
        sizes = [image.size for image in images.values()] or [(MIN_CELL, MIN_CELL)]
        cell_size = (max(w for w, _ in sizes), max(h for _, h in sizes))
    scale = max(1, math.ceil(MIN_CELL / max(1, min(cell_size))))
    cell_w, cell_h = cell_size[0] * scale, cell_size[1] * scale
    font, title_font = _font(FONT_SIZE), _font(TITLE_SIZE)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = FONT_SIZE + 4
    row_lines = [_wrap(label) for label in layout.rows]
    label_w = max((_text_width(measure, line, font) for lines in row_lines for line in lines), default=0)
    label_w = label_w + GAP * 2 if label_w else 0
    header_lines = max((len(_wrap(label)) for label in layout.columns if label), default=0)
    header_h = header_lines * line_h + GAP if header_lines else 0
    title_h = TITLE_SIZE + 2 * GAP
    n_rows, n_cols = len(layout.rows), len(layout.columns)
    width = MARGIN * 2 + label_w + n_cols * cell_w + (n_cols - 1) * GAP
    title_w = _text_width(measure, layout.title, title_font) + MARGIN * 2
    width = max(width, min(title_w, 2400))
    height = MARGIN * 2 + title_h + header_h + n_rows * cell_h + (n_rows - 1) * GAP
    grid = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    draw.text((MARGIN, MARGIN), layout.title, fill=INK, font=title_font)
    top = MARGIN + title_h + header_h
    left = MARGIN + label_w
    for col, label in enumerate(layout.columns):
        x0 = left + col * (cell_w + GAP)
        for i, line in enumerate(_wrap(label) if label else []):
            w = _text_width(measure, line, font)
            draw.text((x0 + (cell_w - w) // 2, MARGIN + title_h + i * line_h), line, fill=INK, font=font)
    for row, lines in enumerate(row_lines):
        y0 = top + row * (cell_h + GAP)
        block = len(lines) * line_h
        for i, line in enumerate(lines):
            draw.text((MARGIN, y0 + (cell_h - block) // 2 + i * line_h), line, fill=INK, font=font)
    for index, (row, col) in sorted(layout.places.items()):
        x0, y0 = left + col * (cell_w + GAP), top + row * (cell_h + GAP)
        image = images.get(index)
        if image is None:
            draw.rectangle((x0, y0, x0 + cell_w - 1, y0 + cell_h - 1), fill=EMPTY)
            note = notes.get(index, "no image")
            w = _text_width(measure, note, font)
            draw.text((x0 + (cell_w - w) // 2, y0 + (cell_h - FONT_SIZE) // 2), note, fill=MUTED, font=font)
            continue
        shown = image.convert("RGB")
        if shown.size != (cell_w, cell_h):
            # Whole-factor nearest upscaling keeps the model's pixels; a cell of another size is fitted.
            target = (shown.width * scale, shown.height * scale)
            if target[0] > cell_w or target[1] > cell_h:
                ratio = min(cell_w / shown.width, cell_h / shown.height)
                target = (max(1, int(shown.width * ratio)), max(1, int(shown.height * ratio)))
            shown = shown.resize(target, Image.Resampling.NEAREST)
        grid.paste(shown, (x0 + (cell_w - shown.width) // 2, y0 + (cell_h - shown.height) // 2))
    return grid
