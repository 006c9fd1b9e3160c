"""A finished job's grid as a run: the labelled grid (``studio/jobs/grid.py``) of its cells' images, kept
as an output file and recorded as a run of its own (source ``job``; docs/jobs.md, "The grid").

A cell that spoke (a model with audio, docs/speech.md) is drawn as its waveform (``waveform_png``): the
grid of a speech job is a labelled picture of its utterances; the Batch tab plays them (``studio/ui/jobs.py``).
"""

from __future__ import annotations

import io
import uuid

import soundfile  # type: ignore[import-untyped]  # ships no type information
from PIL import Image

from studio.accounts.identity import user_of_owner
from studio.jobs.grid import compose_grid, grid_layout
from studio.jobs.spec import JobSpec
from studio.media.audio import waveform_png
from studio.media.images import attach_png_text, png_bytes
from studio.recipes.recipe import grid_recipe_chunks
from studio.store.files import PNG
from studio.store.jobs import FINISHED_ITEM_STATUSES, JobItemRecord, JobRecord
from studio.store.records import OutputRecord
from studio.store.store import RunStore

__all__ = ["cell_output", "cell_picture", "record_grid"]

GRID_NAMESPACE = uuid.UUID("1f7b5a52-2a8e-4e0b-9d6c-6a0f1b0c7d21")  # grid run ids: uuid5(job id)
WAVEFORM_CELL = (256, 128)  # a spoken cell's picture in the grid (128 px high: not scaled up)
AFTER_END = (246, 246, 249)  # a spoken cell's ground past the end of a shorter utterance


def record_grid(
    store: RunStore, job: JobRecord, spec: JobSpec, items: list[JobItemRecord]
) -> tuple[str, str]:
    """Compose the grid, keep it as an output file and record it as a run (source ``job``); the same
    grid run id for a job every time, so a resumed job never records two."""
    outputs = {item.index: cell_output(store, item) for item in items if item.status == "succeeded"}
    # Spoken cells share one time scale: the longest fills its cell, the others as long as they are.
    longest = max(
        (o.duration_seconds or 0.0 for o in outputs.values() if o and o.kind == "audio"), default=0.0
    )
    images: dict[int, Image.Image] = {}
    notes: dict[int, str] = {}
    for item in items:
        output = outputs.get(item.index)
        image = cell_picture(output, longest) if output is not None else None
        if image is not None:
            images[item.index] = image
        elif item.status == "succeeded":  # e.g. a spoken reply with nothing to say (silent)
            notes[item.index] = "no output"
        else:
            notes[item.index] = item.status if item.status in FINISHED_ITEM_STATUSES else "no image"
    grid = compose_grid(grid_layout(spec, job.label), images, notes)
    attach_png_text(grid, grid_recipe_chunks(job.id, job.label, job.spec))  # docs/recipes.md
    data = png_bytes(grid)
    sha, _ = store.write_file(data, PNG)
    grid_run = uuid.uuid5(GRID_NAMESPACE, job.id).hex
    if not store.existing_ids([grid_run]):
        with store.batch():  # the run and its file row together, or neither
            store.create_run(
                source="job",
                prompt=f"grid of {job.label}",
                model=spec.model or "",
                request={"job": job.id, "grid": True, "spec": job.spec},
                parameters={
                    "job": job.id,
                    "cells": len(items),
                    "columns": grid.width,
                    "rows": grid.height,
                },
                run_id=grid_run,
                user_name=user_of_owner(job.owner),  # the job's account's, as its cells (docs/team.md)
            )
            store.add_output_file(grid_run, 0, sha, PNG, grid.width, grid.height, "image", len(data))
            store.finish_run(grid_run, "succeeded")
    return sha, grid_run


def cell_output(store: RunStore, item: JobItemRecord) -> OutputRecord | None:
    """The output a succeeded cell shows: its first image, else its first audio (a file on disk)."""
    from studio.store.errors import RunNotFound

    if item.run_id is None:
        return None
    try:
        run = store.get_run(item.run_id)
    except RunNotFound:
        return None
    kept = [o for o in run.outputs if o.kind in ("image", "audio") and o.path.is_file()]
    return next((o for o in kept if o.kind == "image"), None) or next(iter(kept), None)


def cell_picture(output: OutputRecord, longest: float = 0.0) -> Image.Image:
    """An image output as it is; an audio output as its waveform, ``longest`` seconds filling the width
    (so cells compare by length too), on a faint ground that shows the cell."""
    if output.kind == "image":
        with Image.open(output.path) as opened:
            return opened.convert("RGB")
    samples, rate = soundfile.read(output.path, dtype="float32", always_2d=False)
    width, height = WAVEFORM_CELL
    seconds = samples.size / rate
    drawn_width = max(1, round(width * min(1.0, seconds / longest))) if longest > 0 else width
    cell = Image.new("RGB", WAVEFORM_CELL, AFTER_END)
    with Image.open(io.BytesIO(waveform_png(samples, rate, drawn_width, height))) as drawn:
        cell.paste(drawn.convert("RGB"), (0, 0))
    return cell
