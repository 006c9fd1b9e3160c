"""``/v1/studio/jobs``: submit a batch job, read its status and progress, list jobs, cancel one, fetch its
grid (docs/jobs.md). The work is :class:`studio.jobs.service.JobService`'s; this module turns its answers into
JSON and its refusals into OpenAI error bodies that name the field (``x.values[1]``) and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse

from studio.accounts.identity import current_identity
from studio.api.errors import APIError
from studio.api.protocol_jobs import JobGrid, JobItemOut, JobList, JobObject, JobProgress
from studio.api.serving_base import client_id
from studio.jobs.runner import JobsUnavailable
from studio.jobs.service import JobFinished, JobNotFound, JobService
from studio.jobs.spec import JobSpecError, parse_job_spec
from studio.startup.limits import InputLimits
from studio.store.jobs import JOB_STATUSES, JobRecord

MAX_LIST = 200
PNG_RESPONSE = {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}}
LIST_PARAMETERS = [
    {
        "name": "status",
        "in": "query",
        "required": False,
        "description": f"only jobs with this status (several: comma-separated): {', '.join(JOB_STATUSES)}",
        "schema": {"type": "string"},
    },
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "description": f"at most this many jobs (1-{MAX_LIST}, default 50)",
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST},
    },
]


def job_route_docs(errors: Callable[..., dict[int | str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """What the OpenAPI document says about each job route (``errors(*statuses)``: the error bodies)."""
    return {
        "jobs_create": {
            "response_model": JobObject,
            "summary": "Submit a batch job: prompts x seeds x up to two parameter axes (docs/jobs.md)",
            "responses": errors(400, 401, 413, 503),
        },
        "jobs_list": {
            "response_model": JobList,
            "summary": "Jobs: queued and running ones in queue order, then the others newest first",
            "responses": errors(400, 401, 503),
            "openapi_extra": {"parameters": LIST_PARAMETERS},
        },
        "jobs_get": {
            "response_model": JobObject,
            "summary": "One job: status, progress, its cells and their runs, the grid once done",
            "responses": errors(401, 404, 503),
        },
        "jobs_cancel": {
            "response_model": JobObject,
            "summary": "Cancel a queued or running job (cells not run yet never run)",
            "responses": errors(400, 401, 404, 503),
        },
        "jobs_grid": {
            "summary": "The labelled grid PNG of a finished job",
            "response_class": FileResponse,
            "responses": {200: PNG_RESPONSE, **errors(401, 404, 503)},
        },
    }


def _visible(job: JobRecord) -> bool:
    """Whether the current request's account may see ``job`` (everyone may without accounts)."""
    identity = current_identity()
    return identity is None or identity.sees_all or job.owner == identity.owner


def _stamp(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


class StudioServingJobs:
    """The job endpoints over one :class:`JobService` (the studio's queue)."""

    def __init__(
        self,
        jobs: JobService,
        limits: InputLimits,
        output_url: Callable[[str, str], str],
    ) -> None:
        self.jobs = jobs
        self.limits = limits
        self.output_url = output_url

    def job_object(self, job: JobRecord, base: str, positions: dict[str, int] | None = None) -> JobObject:
        running = sum(1 for item in job.items if item.status == "running") if job.items else 0
        if not job.items and job.active:
            running = self.jobs.running_cells(job.id)
        progress = JobProgress(
            total=job.total,
            succeeded=job.succeeded,
            failed=job.failed,
            cancelled=job.cancelled,
            running=running,
            queued=max(0, job.total - job.done - running),
        )
        grid = None
        if job.grid_sha256 is not None:
            grid = JobGrid(
                sha256=job.grid_sha256, url=self.output_url(base, job.grid_sha256), run_id=job.grid_run_id
            )
        if positions is None:
            positions = self.jobs.positions() if job.active else {}
        items = None
        if job.items:
            items = [
                JobItemOut(
                    index=item.index,
                    status=item.status,  # type: ignore[arg-type]
                    run_id=item.run_id,
                    attempts=item.attempts,
                    axes=item.axes,
                    error=item.error,
                )
                for item in job.items
            ]
        return JobObject(
            id=job.id,
            created=_stamp(job.created_at) or 0,
            started=_stamp(job.started_at),
            finished=_stamp(job.finished_at),
            status=job.status,  # type: ignore[arg-type]
            name=job.name,
            source=job.source,
            owner=job.owner,
            position=positions.get(job.id),
            progress=progress,
            spec=job.spec,
            grid=grid,
            error=job.error,
            items=items,
        )

    def _get(self, job_id: str, items: bool = True) -> JobRecord:
        try:
            job = self.jobs.get(job_id, items=items)
        except JobNotFound:
            raise APIError(404, f"No job with id {job_id!r}", "job_id", "job_not_found") from None
        if not _visible(job):  # another user's job: as if there were none (docs/team.md)
            raise APIError(404, f"No job with id {job_id!r}", "job_id", "job_not_found")
        return job

    def create(self, payload: dict[str, Any], raw: Request) -> JSONResponse:
        try:
            spec = parse_job_spec(payload, self.limits)
            identity = current_identity()  # an account's job is theirs (``user:NAME``), whatever key sent it
            owner = identity.owner if identity is not None and identity.owner else f"api:{client_id(raw)}"
            job = self.jobs.submit(spec, "api", owner)
        except JobSpecError as exc:
            raise APIError(400, f"Invalid job: {exc.summary()}", exc.field or None, "invalid_job") from exc
        except JobsUnavailable as exc:
            error = APIError(503, str(exc), None, "engine_not_ready")
            error.retry_after = 1
            raise error from exc
        base = str(raw.base_url).rstrip("/")
        return JSONResponse(self.job_object(self._get(job.id), base).model_dump(mode="json"))

    def get(self, job_id: str, raw: Request) -> JSONResponse:
        base = str(raw.base_url).rstrip("/")
        return JSONResponse(self.job_object(self._get(job_id), base).model_dump(mode="json"))

    def list(self, raw: Request) -> JSONResponse:
        status = raw.query_params.get("status")
        statuses: tuple[str, ...] | None = None
        if status:
            statuses = tuple(part.strip() for part in status.split(","))
            unknown = [s for s in statuses if s not in JOB_STATUSES]
            if unknown:
                raise APIError(
                    400,
                    f"Invalid value for 'status': {unknown[0]!r}; one or more of {', '.join(JOB_STATUSES)}",
                    "status",
                )
        limit_text = raw.query_params.get("limit", "50")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
            raise APIError(400, f"Invalid value for 'limit': a whole number from 1 to {MAX_LIST}", "limit")
        base = str(raw.base_url).rstrip("/")
        positions = self.jobs.positions()
        jobs = [job for job in self.jobs.list_jobs(statuses, limit=int(limit_text)) if _visible(job)]
        body = JobList(data=[self.job_object(job, base, positions) for job in jobs])
        return JSONResponse(body.model_dump(mode="json"))

    def cancel(self, job_id: str, raw: Request) -> JSONResponse:
        self._get(job_id, items=False)  # 404 for another user's job
        try:
            job = self.jobs.cancel(job_id)
        except JobNotFound:
            raise APIError(404, f"No job with id {job_id!r}", "job_id", "job_not_found") from None
        except JobFinished as exc:
            raise APIError(
                400, f"{exc}; only queued or running jobs can be cancelled", "job_id", "job_finished"
            ) from exc
        base = str(raw.base_url).rstrip("/")
        return JSONResponse(self.job_object(job, base).model_dump(mode="json"))

    def grid(self, job_id: str) -> FileResponse:
        job = self._get(job_id, items=False)
        path = self.jobs.grid_path(job)
        if path is None:
            raise APIError(
                404,
                f"Job {job_id} has no grid yet (it is {job.status}; the grid is made when every cell has run)",
                "job_id",
                "grid_not_ready",
            )
        return FileResponse(path, media_type="image/png")
