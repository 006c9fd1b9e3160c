"""``omni-studio batch JOB.yaml``: run a batch job from the terminal, with a progress bar over its cells and
the grid's path at the end (docs/jobs.md). The job is stored like one submitted to a studio: an
interrupted batch (Ctrl-C, a crash) is finished by ``omni-studio batch --resume ID``, or by the next
``omni-studio serve``/``ui`` on the same data dir.

Importing this module is cheap (argparse only); :func:`run_batch` loads the engine.
"""

from __future__ import annotations

import argparse
import getpass
import shutil
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.errors import UserError

if TYPE_CHECKING:
    from studio.jobs.service import JobService
    from studio.jobs.spec import JobSpec
    from studio.startup.settings import StudioSettings
    from studio.store.jobs import JobRecord


BATCH_EXAMPLES = (
    "omni-studio batch job.yaml --model tiny-glm-shapes --out grid.png",
    "omni-studio batch --resume 3f2a9c01   # finish a job an interrupted batch left",
)


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``batch`` command's own arguments (the shared model/limits/storage flags come from cli.py)."""
    parser.add_argument(
        "file",
        nargs="?",
        default=None,
        metavar="JOB.yaml",
        help="the job: prompts, seeds, x/y axes and fixed values (format: docs/jobs.md)",
    )
    group = parser.add_argument_group("this job")
    group.add_argument("--out", default=None, metavar="FILE", help="also write the grid PNG to FILE")
    group.add_argument(
        "--resume", default=None, metavar="ID", help="finish a stored job that a stopped batch or studio left"
    )
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def owner_of_terminal() -> str:
    """Who submitted a job from this terminal (``cli:USER@HOST``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def _load_spec(path: str, settings: StudioSettings) -> JobSpec:
    from studio.jobs.spec import JobSpecError, load_job_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"no such job file: {path}")
    try:
        return load_job_file(file.read_text(), str(path), settings.limits)
    except JobSpecError as exc:
        raise UserError(exc.render()) from exc


def run_batch(args: argparse.Namespace, settings: StudioSettings) -> int:
    """Run (or resume) one job to its end; exit 0 when every cell succeeded, 1 otherwise, 130 on Ctrl-C."""
    from engine.paths import DEPLOY_PRESETS_DIR
    from studio.jobs.service import JobNotFound, JobService
    from studio.jobs.spec import JobSpec, JobSpecError
    from studio.startup.launch import close_recorder, open_recorder, start_engine

    if (args.file is None) == (args.resume is None):
        raise UserError("give a JOB.yaml file, or --resume ID to finish a stored job")
    recorder = open_recorder(settings)
    engine = None
    service: JobService | None = None
    try:
        resumed = None
        if args.resume is not None:
            from studio.store.jobs import JobStore

            try:
                resumed = JobStore(recorder.store).get_job(args.resume.strip())
            except JobNotFound as exc:
                raise UserError(str(exc)) from exc
            spec = JobSpec.model_validate(resumed.spec)
        else:
            spec = _load_spec(args.file, settings)
        # The engine starts on the job's own model and deploy preset when the flags do not name them, so a
        # job that fixes them needs no second engine.
        if settings.model is None and spec.model is not None:
            settings = replace(settings, model=spec.model)
        if settings.deploy_config is None and isinstance(spec.deploy, str):
            settings = replace(settings, deploy_config=str(DEPLOY_PRESETS_DIR / f"{spec.deploy}.yaml"))
        engine = start_engine(settings)
        served = settings.served_model_name or engine.config.model_name
        bar = _progress_bar(args.quiet)
        service = JobService(
            recorder.store,
            recorder,
            lambda: engine,
            lambda: served,
            limits=settings.limits,
            data_dir=settings.data_dir,
            ar_backend=settings.ar_backend,
            devices=settings.devices,
            only=set(),
            on_change=bar.update if bar is not None else None,
        )
        if resumed is not None:
            if not service.jobs.claim(resumed.id, service.worker, recorder.store.owner_alive):
                state = "finished" if not resumed.active else "still being run by another process"
                raise UserError(f"job {resumed.id} is {state} ({resumed.status})")
            assert service.only is not None
            service.only.add(resumed.id)
            job_id = resumed.id
        else:
            try:
                job_id = service.submit(spec, "cli", owner_of_terminal()).id
            except JobSpecError as exc:
                raise UserError(exc.render()) from exc
        job = service.get(job_id, items=False)
        print(f"job {job.id}: {job.total} cells ({job.label})", file=sys.stderr, flush=True)
        if bar is not None:
            bar.start(job.total, job.done)
        service.start()
        try:
            service.wait(job_id)
        except KeyboardInterrupt:
            service.close()
            print(
                f"\ninterrupted; the cells not done run with: omni-studio batch --resume {job_id}",
                file=sys.stderr,
            )
            return 130
        finally:
            if bar is not None:
                bar.close()
        job = service.get(job_id, items=False)
        return _report(service, job, args.out)
    finally:
        if service is not None:
            service.close()
        if engine is not None:
            engine.close()
        close_recorder(recorder)


def _report(service: JobService, job: JobRecord, out: str | None) -> int:
    """Print the outcome, and the grid's path last (stdout); 0 when every cell succeeded."""
    print(
        f"job {job.id} {job.status}: {job.succeeded}/{job.total} cells succeeded"
        + (f", {job.failed} failed" if job.failed else "")
        + (f", {job.cancelled} cancelled" if job.cancelled else ""),
        file=sys.stderr,
    )
    if job.error and job.status != "succeeded":
        print(f"  {job.error}", file=sys.stderr)
    path = service.grid_path(job)
    if path is None:
        return 1
    if job.grid_run_id:
        print(f"grid recorded as run {job.grid_run_id[:12]}", file=sys.stderr)
    if out:
        target = Path(out).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        path = target
    print(path)
    return 0 if job.status == "succeeded" else 1


class _CellBar:
    """A tqdm bar over a job's cells, moved by the runner's progress callback (another thread)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def start(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=done, desc="cells", unit="cell", file=sys.stderr, dynamic_ncols=True
        )

    def update(self, job: object) -> None:
        done = getattr(job, "done", None)
        if self.bar is not None and isinstance(done, int):
            self.bar.update(max(0, done - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(quiet: bool) -> _CellBar | None:
    return None if quiet else _CellBar()
