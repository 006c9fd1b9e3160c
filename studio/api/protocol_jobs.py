"""Response models of ``/v1/studio/jobs`` (batch and grid jobs, docs/jobs.md).

The request body is :class:`studio.jobs.spec.JobSpec` itself (the same model the CLI's YAML and the Batch
tab use); these are what the API answers with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobProgress(BaseModel):
    """Cells by status."""

    total: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    queued: int


class JobItemOut(BaseModel):
    """One cell: where it sits in the grid, its status and the run that made it."""

    index: int
    status: JobStatus
    run_id: str | None = Field(description="the run of this cell (GET it from the history or the CLI)")
    attempts: int = Field(description="runs started for this cell (more than 1 after a restart)")
    axes: dict[str, Any] = Field(description="prompt_index, prompt, seed, and the x / y values")
    error: str | None = None


class JobGrid(BaseModel):
    """The labelled grid of a finished job (also a recorded run, source 'job')."""

    sha256: str
    url: str = Field(description="/v1/outputs/<sha256>.png (signed when an API key is set)")
    run_id: str | None


class JobObject(BaseModel):
    """A batch job: its spec (model and seeds fixed at submission), status, queue place and progress."""

    id: str
    object: Literal["studio.job"] = "studio.job"
    created: int
    started: int | None = None
    finished: int | None = None
    status: JobStatus
    name: str | None
    source: str = Field(description="where it was submitted: api, ui or cli")
    owner: str | None = Field(description="who submitted it (may cancel it)")
    position: int | None = Field(description="place in the queue (1 runs first); null once finished")
    progress: JobProgress
    spec: dict[str, Any]
    grid: JobGrid | None = None
    error: str | None = None
    items: list[JobItemOut] | None = Field(None, description="the cells (GET /v1/studio/jobs/{job_id})")


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
