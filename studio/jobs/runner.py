"""The job runner: a thread that works through the queue, running each job's cells in the engine.

Cells are fed into the engine through the one run path (:class:`studio.runs.service.RunService`), several
at a time, so they batch with everyone else's requests and are recorded as runs (source ``job``).
:class:`JobRunner` holds the state the runner and the job service (``studio/jobs/service.py``, which
submits, reads and cancels jobs) share.

Restart safety (docs/jobs.md, "Restart"): a cell's run id is written before the run starts; its outcome
is written only once the run's own outcome is in the store. After a crash (``kill -9``) the next studio
takes over the dead process's jobs; for each cell that was running it looks at that run: succeeded ->
the cell is done (no second run), anything else (interrupted, missing) -> the cell runs again. So every
cell ends with exactly one succeeded run. When every cell has an outcome, the labelled grid
(``studio/jobs/grid_run.py``) is composed, kept as an output file and recorded as a run of its own.

Cells for another model or deploy preset than the served one run on an engine the runner builds for
them, one at a time, closed when their cells are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from engine import GenerationParams, GenerationRequest, OmniEngine, RequestError
from engine.building import build_pipeline_config
from engine.config import DeployConfigError, PipelineConfig
from engine.engine import EngineBuildError, build_engine
from engine.events import RunFailed, RunFinished
from engine.modality import OutputModality
from engine.models import ModelNotFound, ModelSource, describe_model
from engine.paths import DEPLOY_PRESETS_DIR
from studio.accounts.identity import user_of_owner
from studio.jobs.grid_run import record_grid
from studio.jobs.spec import CellParameters, JobCell, JobSpec
from studio.runs.inflight import RequestBoard
from studio.runs.service import RunRejected, RunService
from studio.startup.limits import InputLimits
from studio.store.jobs import JobItemRecord, JobNotFound, JobRecord, JobStore
from studio.store.models import ACTIVE_JOB_STATUSES
from studio.store.store import RunStore

if TYPE_CHECKING:
    from studio.store.recorder import RunRecorder

__all__ = ["JobRunner", "JobsUnavailable", "Target", "cell_request"]

log = logging.getLogger("omni_studio.jobs")

IDLE_POLL_S = 1.0  # how often an idle runner looks for work submitted by another process
CLAIM_EVERY_S = 10.0  # how often it looks for jobs whose process died (PostgreSQL: several studios)
CANCEL_POLL_S = 0.5  # how often a running job checks whether it was cancelled elsewhere
MAX_WINDOW = 16  # cells of one job in the engine at once, at most
FLUSH_TIMEOUT_S = 30.0
STOPPED = "the studio stopped before this cell finished; it runs again when the studio restarts"
CANCELLED = "the job was cancelled"


class JobsUnavailable(RuntimeError):
    """Jobs cannot be taken now (no engine loaded yet, or the service is stopping)."""


@dataclass(frozen=True)
class Target:
    """Which engine a cell needs: a model and a deploy config (``None``: the model's served or default one)."""

    model: str
    deploy: str | dict[str, Any] | None

    @property
    def key(self) -> str:
        return json.dumps([self.model, self.deploy], sort_keys=True)


def cell_request(params: CellParameters, request_id: str | None = None) -> GenerationRequest:
    """The engine request of one cell (the same fields an API request would set). A speech job's cell sets
    the voice and speed; with ``say`` the prompt is the words to say, audio only (as /v1/audio/speech)."""
    fields = params.fields()
    extra: dict[str, Any] = {}
    if params.say:
        extra = {"speak_text": params.prompt, "modalities": (OutputModality.AUDIO,)}
    if request_id is not None:
        extra["request_id"] = request_id
    return GenerationRequest(
        params.prompt,
        GenerationParams(
            seed=fields["seed"],
            height=fields.get("height"),
            width=fields.get("width"),
            num_inference_steps=fields.get("num_inference_steps"),
            guidance_scale=fields.get("guidance_scale"),
            negative_prompt=fields.get("negative_prompt"),
            voice=fields.get("voice"),
            speed=fields.get("speed"),
        ),
        **extra,
    )


class JobRunner:
    """The runner of one studio process (or one ``omni-studio batch``): its thread, the job it runs and
    the cells of it in the engine."""

    def __init__(
        self,
        store: RunStore,
        recorder: RunRecorder | None,
        serving_engine: Callable[[], OmniEngine | None],
        served_name: Callable[[], str],
        *,
        fingerprint: Callable[[PipelineConfig], str | None] = lambda config: None,
        limits: InputLimits | None = None,
        data_dir: Path | None = None,
        ar_backend: str | None = None,
        devices: str | None = None,
        board: RequestBoard | None = None,
        only: set[str] | None = None,
        on_change: Callable[[JobRecord], None] | None = None,
    ) -> None:
        self.store = store
        self.jobs = JobStore(store)
        self.recorder = recorder
        self.serving_engine = serving_engine
        self.served_name = served_name
        self.fingerprint = fingerprint
        self.limits = limits or InputLimits()
        self.data_dir = Path(data_dir) if data_dir is not None else store.data_dir
        self.ar_backend = ar_backend
        self.devices = devices
        self.board = board
        self.worker = store.owner  # the runs.owner format: other processes can tell whether we live
        self.runs = RunService(recorder, "job", store.files, limits=self.limits, board=board)
        # ``omni-studio batch`` runs only its own job (None: every job this process owns or takes over).
        self.only = only
        self.on_change = on_change
        self._lock = threading.Lock()
        self._in_flight: dict[str, tuple[str, int, OmniEngine]] = {}  # run id -> (job, item, engine)
        self._cancelled: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._finished: dict[str, threading.Event] = {}
        self._outputs: dict[str, str] = {}  # model name -> what its cells make (JobService.output_of)

    def _engine(self) -> OmniEngine:
        engine = self.serving_engine()
        if engine is None or self._stopping:
            raise JobsUnavailable("the engine is not ready (starting or being rebuilt); retry shortly")
        return engine

    def _is_served(self, model: str, engine: OmniEngine) -> bool:
        return model in (engine.model.name, self.served_name())

    def _config_for(self, target: Target, engine: OmniEngine) -> PipelineConfig:
        """The pipeline config a target runs with (raises DeployConfigError, ModelNotFound...)."""
        served = self._is_served(target.model, engine)
        if served and target.deploy is None:
            return engine.config
        source: ModelSource = engine.model if served else describe_model(target.model)
        deploy: Any = target.deploy
        if isinstance(deploy, str):
            deploy = DEPLOY_PRESETS_DIR / f"{deploy}.yaml"
        return build_pipeline_config(source, deploy, self.ar_backend, self.devices)

    def _target(self, params: CellParameters, engine: OmniEngine) -> Target:
        model = params.model or engine.model.name
        if model == self.served_name():
            model = engine.model.name
        return Target(model, params.deploy)

    # -- the runner thread -----------------------------------------------------------------------

    def start(self) -> Self:
        """Start the runner: take over jobs of dead processes, then work through the queue."""
        if self._thread is None:
            ready = threading.Event()
            self._thread = threading.Thread(
                target=lambda: asyncio.run(self._run(ready)), name="omni-jobs", daemon=True
            )
            self._thread.start()
            ready.wait(10)
        return self

    def close(self, timeout: float = 15.0) -> None:
        """Stop the runner: cells in the engine are stopped and go back to the queue (they run again at
        the next start), their runs recorded cancelled."""
        self._stopping = True
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(main.cancel)
        if self._thread is not None:
            self._thread.join(timeout)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    async def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._main = asyncio.current_task()
        ready.set()
        try:
            await self._work()
        except asyncio.CancelledError:
            pass
        except Exception:  # the runner must not die silently: the queue would stall
            log.exception("the job runner stopped")

    async def _work(self) -> None:
        last_claim = 0.0
        while not self._stopping:
            if self.only is None and time.monotonic() - last_claim > CLAIM_EVERY_S:
                last_claim = time.monotonic()
                claimed = await asyncio.to_thread(
                    self.jobs.claim_orphans, self.worker, self.store.owner_alive
                )
                if claimed:
                    log.warning("jobs: took over %d job(s) of a stopped process: %s", len(claimed), claimed)
            job = await asyncio.to_thread(self._next_job)
            if job is not None and self.serving_engine() is None:
                job = None  # no engine (loading, being replaced): the job waits, it does not fail
            if job is None:
                assert self._wake is not None
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                continue
            try:
                await self._run_job(job)
            except asyncio.CancelledError:
                raise
            except JobsUnavailable:  # the engine went away meanwhile: the job waits for the next one
                await asyncio.sleep(IDLE_POLL_S)
                continue
            except Exception as exc:  # a job that cannot run must not block the queue behind it
                log.exception("job %s failed", job.id)
                self.jobs.finish_job(job.id, "failed", f"the job runner failed: {type(exc).__name__}: {exc}")
            self._job_changed(job.id)

    def _next_job(self) -> JobRecord | None:
        for job in self.jobs.list_jobs(ACTIVE_JOB_STATUSES, limit=100, worker=self.worker):
            if self.only is None or job.id in self.only:
                return job
        return None

    def _job_changed(self, job_id: str) -> None:
        try:
            job = self.jobs.get_job(job_id)
        except JobNotFound:
            return
        if self.on_change is not None:
            self.on_change(job)
        if not job.active:
            self._finished.setdefault(job_id, threading.Event()).set()

    def _is_cancelled(self, job_id: str) -> bool:
        with self._lock:
            if job_id in self._cancelled:
                return True
        return self.jobs.get_job(job_id).status == "cancelled"

    # -- one job ---------------------------------------------------------------------------------

    async def _run_job(self, job: JobRecord) -> None:
        self.jobs.mark_running(job.id)
        spec = JobSpec.model_validate(job.spec)
        cells = spec.cells()
        await self._reconcile(job)
        while not self._stopping:
            items = [i for i in self.jobs.items(job.id) if i.status == "queued"]
            if not items or self._is_cancelled(job.id):
                break
            engine = self._engine()
            target = self._target(spec.parameters(cells[items[0].index]), engine)
            group = [i for i in items if self._target(spec.parameters(cells[i.index]), engine) == target]
            await self._run_group(job, spec, cells, group, target)
        if self._stopping:
            return  # the rest runs when a studio starts again
        if self._is_cancelled(job.id):
            self.jobs.cancel_job(job.id)  # cells left queued by a cancel from another process
            return
        items = self.jobs.items(job.id)
        sha, grid_run = await asyncio.to_thread(record_grid, self.store, job, spec, items)
        failed = [i for i in items if i.status != "succeeded"]
        error = f"{len(failed)} of {len(items)} cells did not succeed" if failed else None
        self.jobs.finish_job(job.id, "failed" if failed else "succeeded", error, sha, grid_run)

    async def _reconcile(self, job: JobRecord) -> None:
        """Cells left ``running`` by a process that stopped: settle each by what its run became."""
        stale = [i for i in self.jobs.items(job.id) if i.status == "running"]
        if not stale:
            return
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.flush, FLUSH_TIMEOUT_S)
        for item in stale:
            status, error = self._run_outcome(item.run_id)
            if status == "succeeded":
                self.jobs.finish_item(job.id, item.index, "succeeded")
            elif status == "failed" and not (error or "").startswith("rejected:"):
                self.jobs.finish_item(job.id, item.index, "failed", error)
            else:  # interrupted, cancelled by the stop, refused, or never recorded: run it again
                self.jobs.requeue_item(job.id, item.index)
        log.warning("jobs: job %s resumed; %d cell(s) were cut off", job.id, len(stale))

    def _run_outcome(self, run_id: str | None) -> tuple[str | None, str | None]:
        from studio.store.errors import RunNotFound

        if run_id is None:
            return None, None
        try:
            run = self.store.get_run(run_id)
        except RunNotFound:
            return None, None
        return run.status, run.error

    def _window(self, engine: OmniEngine) -> int:
        """Cells in the engine at once: enough to fill every stage's batch, never the whole queue."""
        seats = sum(stage.engine_args.batch_size for stage in engine.config.stages)
        return max(2, min(MAX_WINDOW, seats, engine.max_pending - 1))

    async def _run_group(
        self, job: JobRecord, spec: JobSpec, cells: list[JobCell], items: list[JobItemRecord], target: Target
    ) -> None:
        """Run cells that share an engine: the served one, or one built for them (closed after)."""
        served = self._engine()
        own: OmniEngine | None = None
        if self._is_served(target.model, served) and self._config_for(target, served).config_hash() == (
            served.config_hash
        ):
            engine = served
        else:
            try:
                own = await asyncio.to_thread(
                    build_engine,
                    target.model,
                    self._deploy_of(target),
                    data_dir=self.data_dir,
                    ar_backend=self.ar_backend,
                    devices=self.devices,
                    max_pending=served.max_pending,
                )
            except (EngineBuildError, DeployConfigError, ModelNotFound, ValueError) as exc:
                for item in items:
                    self._record_failure(
                        job, item, target, f"the engine for {target.model} did not start: {exc}"
                    )
                return
            engine = own
        try:
            await self._run_items(job, spec, cells, items, engine, target, own is None)
        finally:
            if own is not None:
                await asyncio.to_thread(own.close)

    @staticmethod
    def _deploy_of(target: Target) -> Any:
        if isinstance(target.deploy, str):
            return DEPLOY_PRESETS_DIR / f"{target.deploy}.yaml"
        return target.deploy

    async def _run_items(
        self,
        job: JobRecord,
        spec: JobSpec,
        cells: list[JobCell],
        items: list[JobItemRecord],
        engine: OmniEngine,
        target: Target,
        served: bool,
    ) -> None:
        queue = list(items)
        tasks: dict[asyncio.Task[bool], JobItemRecord] = {}
        window = self._window(engine)
        cancelled = False
        last_check = 0.0  # checked before the first cell starts (a cancel while its engine was built)
        try:
            while queue or tasks:
                if not cancelled and time.monotonic() - last_check >= CANCEL_POLL_S:
                    last_check = time.monotonic()
                    if self._is_cancelled(job.id):
                        cancelled = True
                        self._stop_cells(job.id)
                # The served engine was replaced (Apply, another model): the rest is planned again.
                swapped = served and self.serving_engine() is not engine
                while (
                    queue
                    and not cancelled
                    and not swapped
                    and len(tasks) < window
                    and engine.in_flight < engine.max_pending - 1  # leave room for interactive requests
                ):
                    item = queue.pop(0)
                    cell = cells[item.index]
                    tasks[asyncio.create_task(self._run_item(job, spec, cell, engine, target, served))] = item
                if not tasks:
                    if cancelled or swapped:
                        return
                    await asyncio.sleep(0.1)  # the engine is full: wait for room
                    continue
                done, _ = await asyncio.wait(
                    set(tasks), timeout=CANCEL_POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    item = tasks.pop(task)
                    if not task.result():  # refused (queue full, engine replaced): it goes again
                        queue.append(item)
                        await asyncio.sleep(0.2)
                    self._job_changed(job.id)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _stop_cells(self, job_id: str) -> None:
        with self._lock:
            running = [(rid, engine) for rid, (jid, _, engine) in self._in_flight.items() if jid == job_id]
        for run_id, engine in running:
            engine.cancel(run_id)

    async def _run_item(
        self, job: JobRecord, spec: JobSpec, cell: JobCell, engine: OmniEngine, target: Target, served: bool
    ) -> bool:
        """Run one cell; False when the engine refused it (it should be queued again)."""
        params = spec.parameters(cell)
        run_id = uuid.uuid4().hex
        # Written and committed before the run exists: after a crash this tells which run to look at.
        await asyncio.to_thread(self.jobs.start_item, job.id, cell.index, run_id)
        request = cell_request(params, run_id)
        payload = {"job": job.id, "item": cell.index, "prompt": params.prompt, **params.fields()}
        if params.say:
            payload["say"] = True
        if params.model is not None:
            payload["model"] = params.model
        if params.deploy is not None:
            payload["deploy"] = params.deploy
        model_name = self.served_name() if served else target.model
        fingerprint = self.fingerprint(engine.config)
        try:
            resolved = self.runs.resolve(engine, request)
        except RequestError as exc:
            self._record_failure(
                job, None, target, str(exc), index=cell.index, payload=payload, engine=engine
            )
            return True
        # A job of an account (owner ``user:NAME``, docs/team.md): its cells are that user's runs.
        tracker = self.runs.start(
            engine, resolved, model_name, fingerprint, payload, user=user_of_owner(job.owner)
        )
        with self._lock:
            self._in_flight[run_id] = (job.id, cell.index, engine)
        try:
            terminal = await self.runs.run_to_end(engine, resolved, tracker, stopped=STOPPED, owner=job.owner)
        except RunRejected:
            await asyncio.to_thread(self.jobs.requeue_item, job.id, cell.index)
            return False
        except asyncio.CancelledError:  # the studio is stopping: the cell runs again at the next start
            await asyncio.shield(asyncio.to_thread(self.jobs.requeue_item, job.id, cell.index))
            raise
        finally:
            with self._lock:
                self._in_flight.pop(run_id, None)
        if self.recorder is not None:  # the run's outcome is in the store before the cell's
            await asyncio.to_thread(self.recorder.flush, FLUSH_TIMEOUT_S)
        if isinstance(terminal, RunFinished):
            status, error = "succeeded", None
        elif isinstance(terminal, RunFailed) and terminal.cancelled:
            if self._stopping:
                await asyncio.to_thread(self.jobs.requeue_item, job.id, cell.index)
                return True
            status, error = "cancelled", terminal.message or CANCELLED
        else:
            status = "failed"
            error = terminal.message if isinstance(terminal, RunFailed) else "the engine ended the run"
        await asyncio.to_thread(self.jobs.finish_item, job.id, cell.index, status, error)
        return True

    def _record_failure(
        self,
        job: JobRecord,
        item: JobItemRecord | None,
        target: Target,
        message: str,
        *,
        index: int | None = None,
        payload: dict[str, Any] | None = None,
        engine: OmniEngine | None = None,
    ) -> None:
        """A cell that could not run: recorded as a failed run (nothing is lost) and the cell failed."""
        index = item.index if item is not None else index
        assert index is not None
        run_id = None
        if self.recorder is not None:
            run_id = self.recorder.record_rejected(
                "job",
                payload or {"job": job.id, "item": index},
                message,
                target.model,
                engine.config if engine is not None else None,
                self.fingerprint(engine.config) if engine is not None else None,
            )
        self.jobs.finish_item(job.id, index, "failed", message, run_id=run_id)
