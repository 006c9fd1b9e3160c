"""Batch jobs: submit, inspect, cancel and reorder them; the runner that works through the queue is
:class:`studio.jobs.runner.JobRunner`, which :class:`JobService` extends.

:class:`JobService` is what the API (``/v1/studio/jobs``), the Batch and Queue tabs and ``omni-studio
batch`` call. A job is checked against the running studio when submitted (models it can load, what each
cell resolves to) and stored with one item per cell (``studio/store/jobs.py``); its background runner
(``studio/jobs/runner.py``) then runs the cells, restart-safe (docs/jobs.md, "Restart"), and records the
job's labelled grid (``studio/jobs/grid_run.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine import OmniEngine, RequestError
from engine.building import build_pipeline_config, device_problems
from engine.config import DeployConfigError, PipelineConfig
from engine.modality import OutputModality
from engine.models import ModelNotFound, ModelSource, describe_model
from engine.pipelines import UnknownModelFamily
from engine.tiny import BUILTIN_MODELS
from studio.jobs.runner import JobRunner, Target, cell_request
from studio.jobs.spec import AXIS_NAMES, JobCell, JobSpec, JobSpecError, SpecProblem
from studio.runs.inflight import RequestBoard
from studio.store.files import PNG
from studio.store.jobs import JobNotFound, JobRecord

if TYPE_CHECKING:
    from studio.startup.settings import StudioSettings
    from studio.store.recorder import RunRecorder

__all__ = ["JobFinished", "JobNotFound", "JobService"]


class JobFinished(ValueError):
    """The job has already finished: it cannot be cancelled or moved."""


class ServingView(Protocol):
    """What the job service reads from the API's serving state (``studio.api.state.ServingState``)."""

    engine: OmniEngine | None
    board: RequestBoard
    options: Any  # ServingOptions: the fingerprint settings

    @property
    def served_model_name(self) -> str: ...


def spec_path(spec: JobSpec, cell: JobCell, param: str) -> str:
    """The field of ``spec`` that gave ``cell`` its ``param`` (an axis value or the fixed field)."""
    for name in AXIS_NAMES:
        axis = getattr(spec, name)
        index = getattr(cell, name)
        if axis is not None and axis.param == param and index is not None:
            return f"{name}.values[{index}]"
    return param


# Engine request fields -> the job spec's names (a cell's RequestError names an engine field).
ENGINE_FIELDS = {
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "height": "size",
    "width": "size",
    "negative_prompt": "negative_prompt",
    "voice": "voice",
    "speed": "speed",
    "speak_text": "say",  # a model that cannot say given words
    "modalities": "say",  # say asks for audio alone
}


def output_kind(produced: tuple[OutputModality, ...]) -> str:
    """What a job's cell of a model making ``produced`` shows: ``audio`` (a player), ``image``, or the rest."""
    if OutputModality.AUDIO in produced:
        return "audio"
    if OutputModality.IMAGE in produced:
        return "image"
    return "+".join(produced)


def output_label(spec: JobSpec, kinds: list[str]) -> str:
    """A job's output in words (the Queue and Batch tabs): ``image``, ``audio · voices Chelsie, Ethan``."""
    label = ", ".join(kinds) or "?"
    if "audio" in kinds:
        voices = [spec.voice] if spec.voice else []
        voices += [str(v) for axis in spec.axes().values() if axis.param == "voice" for v in axis.values]
        label += (
            f" · voice{'s' if len(voices) > 1 else ''} {', '.join(voices)}" if voices else " · default voice"
        )
        if spec.say:
            label += " · says the prompts"
    return label


class JobService(JobRunner):
    """Jobs of one studio process (or one ``omni-studio batch``): the queue, and the runner behind it."""

    @classmethod
    def for_serving(cls, serving: ServingView, recorder: RunRecorder, settings: StudioSettings) -> JobService:
        """The job service of a studio process (``serve`` and ``ui``): its cells run on the served engine,
        with the fingerprint the API serves (read at each run: the Serving tab may change it)."""
        from studio.api.fingerprint import system_fingerprint

        return cls(
            recorder.store,
            recorder,
            lambda: serving.engine,
            lambda: serving.served_model_name,
            fingerprint=lambda config: system_fingerprint(serving.options.fingerprint, config),
            limits=settings.limits,
            data_dir=settings.data_dir,
            ar_backend=settings.ar_backend,
            devices=settings.devices,
            board=serving.board,
        )

    # -- submitting and reading ------------------------------------------------------------------

    def check(self, spec: JobSpec) -> JobSpec:
        """``spec`` as it will be stored (model and seeds fixed), checked against what this studio can run:
        each model and deploy config, and every cell resolved as the engine would; raises JobSpecError."""
        engine = self._engine()
        spec = spec.with_defaults(model=engine.model.name)
        allowed = sorted({*BUILTIN_MODELS, engine.model.name, self.served_name()})
        problems: list[SpecProblem] = []
        targets: dict[str, tuple[ModelSource, PipelineConfig] | None] = {}
        for cell in spec.cells():
            params = spec.parameters(cell)
            target = self._target(params, engine)
            if target.key not in targets:
                targets[target.key] = self._check_target(spec, cell, target, engine, allowed, problems)
            checked = targets[target.key]
            if checked is None:
                continue
            source, config = checked
            try:
                request = cell_request(params)
                if config is engine.config:
                    self.runs.resolve(engine, request)  # the limits and the context check too
                else:
                    resolved = source.family.resolve_request(request, config)
                    source.family.check_voice(resolved, source.path, target.model)
            except RequestError as exc:
                if exc.field in ("prompt", "history"):
                    where = f"prompts[{cell.prompt_index}]"
                elif exc.field == "seed":
                    where = f"seeds[{(spec.seeds or [cell.seed]).index(cell.seed)}]"
                else:
                    where = spec_path(spec, cell, ENGINE_FIELDS.get(exc.field, exc.field))
                said = exc.message if exc.message.startswith(exc.field) else f"{exc.field} {exc.message}"
                problem = SpecProblem(where, said)
                if problem not in problems:
                    problems.append(problem)
        if problems:
            raise JobSpecError(problems)
        return spec

    def _check_target(
        self,
        spec: JobSpec,
        cell: JobCell,
        target: Target,
        engine: OmniEngine,
        allowed: list[str],
        problems: list[SpecProblem],
    ) -> tuple[ModelSource, PipelineConfig] | None:
        """The model and config of a target, or None with its problems added (naming the spec's field)."""
        where_model = spec_path(spec, cell, "model")
        where_deploy = spec_path(spec, cell, "deploy")
        if target.model not in allowed:
            problems.append(
                SpecProblem(where_model, f"unknown model {target.model!r}; allowed: {', '.join(allowed)}")
            )
            return None
        try:
            source = engine.model if self._is_served(target.model, engine) else describe_model(target.model)
            config = self._config_for(target, engine)
        except DeployConfigError as exc:
            problems.extend(SpecProblem(where_deploy, str(p)) for p in exc.problems)
            return None
        except (ModelNotFound, UnknownModelFamily, ValueError) as exc:
            problems.append(SpecProblem(where_model, str(exc)))
            return None
        devices = device_problems(config)
        if devices:
            problems.extend(SpecProblem(where_deploy, str(p)) for p in devices)
            return None
        produced = source.family.final_modalities(config)
        if OutputModality.IMAGE not in produced and OutputModality.AUDIO not in produced:
            problems.append(
                SpecProblem(
                    where_model,
                    f"{target.model} makes {'+'.join(produced)}, not images or audio: a job's cells form a "
                    "grid of pictures or a table of players",
                )
            )
            return None
        self.outputs()[target.model] = output_kind(produced)
        return source, config

    def submit(self, spec: JobSpec, source: str, owner: str | None) -> JobRecord:
        """Check and queue a job (at the end of the queue); the runner starts it when its turn comes."""
        spec = self.check(spec)
        items = [spec.axes_of(cell) for cell in spec.cells()]
        job = self.jobs.create_job(
            spec=spec.model_dump(mode="json"),
            items=items,
            source=source,
            owner=owner,
            name=spec.name,
            worker=self.worker,
        )
        if self.only is not None:
            self.only.add(job.id)
        self._finished[job.id] = threading.Event()
        self._poke()
        return job

    def outputs(self) -> dict[str, str]:
        """Model name -> what its cells make (:func:`output_kind`), learnt as jobs are checked or shown."""
        return self._outputs

    def output_of(self, job: JobRecord) -> str:
        """What a job's cells make, in words (:func:`output_label`): ``audio · voices Chelsie, Ethan``."""
        spec = JobSpec.model_validate(job.spec)
        models = dict.fromkeys(spec.parameters(cell).model or spec.model or "" for cell in spec.cells())
        known = self.outputs()
        kinds: list[str] = []
        for model in models:
            if model not in known:
                known[model] = self._output_of_model(model)
            kinds.append(known[model])
        return output_label(spec, list(dict.fromkeys(kinds)))

    def _output_of_model(self, model: str) -> str:
        engine = self.serving_engine()
        try:
            if engine is not None and self._is_served(model, engine):
                return output_kind(engine.family.final_modalities(engine.config))
            source = describe_model(model)
            config = build_pipeline_config(source, None, self.ar_backend, self.devices)
            return output_kind(source.family.final_modalities(config))
        except (DeployConfigError, ModelNotFound, UnknownModelFamily, ValueError):
            return "?"

    def get(self, job_id: str, items: bool = True) -> JobRecord:
        return self.jobs.get_job(job_id, items=items)

    def list_jobs(self, statuses: tuple[str, ...] | None = None, limit: int = 50) -> list[JobRecord]:
        """Jobs with one of ``statuses`` (all when None): active ones in queue order, others newest first."""
        return self.jobs.list_jobs(statuses, limit=limit)

    def positions(self) -> dict[str, int]:
        """Job id -> its place in the queue (1: runs first) for every queued or running job."""
        return self.jobs.queue_positions()

    def grid_path(self, job: JobRecord) -> Path | None:
        """Where the job's grid PNG is (None until the job has finished with one)."""
        if job.grid_sha256 is None:
            return None
        path = self.store.files.path(job.grid_sha256, PNG)
        return path if path.is_file() else None

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job: cells not started never run, running ones stop (recorded
        cancelled). Raises JobNotFound, or JobFinished when it had already finished."""
        if not self.jobs.cancel_job(job_id):
            job = self.jobs.get_job(job_id)
            raise JobFinished(f"job {job_id} has already finished ({job.status})")
        with self._lock:
            self._cancelled.add(job_id)
            running = [(rid, engine) for rid, (jid, _, engine) in self._in_flight.items() if jid == job_id]
        for run_id, engine in running:
            engine.cancel(run_id)
        self._poke()
        return self.jobs.get_job(job_id, items=True)

    def move(self, job_id: str, steps: int) -> bool:
        """Move a queued or running job ``steps`` places (negative: earlier); raises JobFinished when it
        has finished. The runner takes the first queued job next (a running job finishes first)."""
        job = self.jobs.get_job(job_id)
        if not job.active:
            raise JobFinished(f"job {job_id} has already finished ({job.status})")
        moved = self.jobs.move_job(job_id, steps)
        self._poke()
        return moved

    def running_cells(self, job_id: str) -> int:
        """Cells of the job in the engine now (this process)."""
        with self._lock:
            return sum(1 for jid, _, _ in self._in_flight.values() if jid == job_id)

    def job_of_run(self, run_id: str) -> tuple[str, int] | None:
        """(job id, item index) of a cell running now as ``run_id``."""
        with self._lock:
            found = self._in_flight.get(run_id)
        return (found[0], found[1]) if found else None

    def wait(self, job_id: str, timeout: float | None = None) -> bool:
        """Block until the job finishes (this process's runner); False on timeout."""
        event = self._finished.setdefault(job_id, threading.Event())
        return event.wait(timeout)
