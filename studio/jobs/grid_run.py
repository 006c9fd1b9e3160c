"""A finished job's grid as a run: the labelled grid (``studio/jobs/grid.py``) of its cells' images, kept
as an output file and recorded as a run of its own (source ``job``; docs/jobs.md, "The grid").
"""

from __future__ import annotations

import uuid

from PIL import Image

from studio.jobs.grid import compose_grid, grid_layout
from studio.jobs.spec import JobSpec
from studio.media.images import attach_png_text, png_bytes
from studio.recipes.recipe import grid_recipe_chunks
from studio.store.files import PNG
from studio.store.jobs import FINISHED_ITEM_STATUSES, JobItemRecord, JobRecord
from studio.store.store import RunStore

__all__ = ["cell_image", "record_grid"]

GRID_NAMESPACE = uuid.UUID("1f7b5a52-2a8e-4e0b-9d6c-6a0f1b0c7d21")  # grid run ids: uuid5(job id)


def record_grid(
    store: RunStore, job: JobRecord, spec: JobSpec, items: list[JobItemRecord]
) -> tuple[str, str]:
    """Compose the grid, keep it as an output file and record it as a run (source ``job``); the same
    grid run id for a job every time, so a resumed job never records two."""
    images: dict[int, Image.Image] = {}
    notes: dict[int, str] = {}
    for item in items:
        image = cell_image(store, item) if item.status == "succeeded" else None
        if image is None:
            notes[item.index] = item.status if item.status in FINISHED_ITEM_STATUSES else "no image"
        else:
            images[item.index] = image
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
            )
            store.add_output_file(grid_run, 0, sha, PNG, grid.width, grid.height, "image", len(data))
            store.finish_run(grid_run, "succeeded")
    return sha, grid_run


def cell_image(store: RunStore, item: JobItemRecord) -> Image.Image | None:
    from studio.store.errors import RunNotFound

    if item.run_id is None:
        return None
    try:
        run = store.get_run(item.run_id)
    except RunNotFound:
        return None
    output = next((o for o in run.outputs if o.kind == "image"), None)
    if output is None or not output.path.is_file():
        return None
    with Image.open(output.path) as opened:
        return opened.convert("RGB")
