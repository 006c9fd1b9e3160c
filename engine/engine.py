"""The orchestrator: builds stage runners from a validated pipeline config and runs requests through them.

Each stage has one worker thread (:mod:`engine.workers`) that takes queued jobs, batches compatible ones
(up to the stage's ``max_num_seqs``) and runs them; a finished job's outputs pass through the next stage's input processor
and are queued there, so different requests occupy different stages at once. Everything a request does
is reported as events (:mod:`engine.events`) to the sink given at submission; :meth:`OmniEngine.generate`
turns that into an async iterator and :meth:`OmniEngine.stream` into a blocking one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.building import build_pipeline_config, device_problems
from engine.client_load import ClientLoad
from engine.config import (
    ConfigProblem,
    DeployConfig,
    DeployConfigError,
    PipelineConfig,
    ResolvedStage,
)
from engine.context_check import check_context
from engine.events import (
    STREAMING_EVENTS,
    TERMINAL_EVENTS,
    EngineEvent,
    ErrorType,
    RunFailed,
    RunFinished,
    StageFinished,
    StageStarted,
    StageStatus,
)
from engine.modality import OutputAccumulator, parse_output_modalities
from engine.models import ModelCard, ModelSource, describe_model, materialize, model_card
from engine.paths import default_data_dir, model_cache_dir
from engine.processors import INPUT_PROCESSORS
from engine.request import GenerationRequest, RequestError, ResolvedRequest
from engine.run_output import run_output
from engine.runner_factory import runner_factory
from engine.stages.base import StageJob, StageRunner
from engine.streaming import CHUNK_FEED_KEY, PUBLISH_KEY, ChunkFeed, chunking_problems
from engine.workers import EventSink, RequestHandle, StageWorker, Ticket, Variant

log = logging.getLogger("omni_studio.engine")


class EngineBuildError(RuntimeError):
    """The engine could not start; stages that had started were shut down."""


class EngineBusy(RuntimeError):
    """Too many requests in flight (the API answers 429)."""


class EngineClosed(RuntimeError):
    """The engine was shut down."""


# -- the engine -----------------------------------------------------------------------------------


class OmniEngine:
    """A running multi-stage pipeline."""

    def __init__(
        self,
        config: PipelineConfig,
        model: ModelSource,
        runners: dict[int, StageRunner],
        max_pending: int = 64,
    ) -> None:
        self.config = config
        self.model = model
        self.family = model.family
        self.runners = runners
        self.max_pending = max_pending
        self._lock = threading.RLock()
        self._handles: dict[str, RequestHandle] = {}
        self.client_load = ClientLoad()  # requests in flight per client: lighter clients first
        self._closed = False
        self._modalities = {s.stage_id: parse_output_modalities(s.engine_output_type) for s in config.stages}
        self.workers = {sid: StageWorker(runner, self) for sid, runner in runners.items()}
        # Per source stage, the stages that consume it in chunks while it generates (engine/streaming.py).
        self._chunked_consumers = {
            s.stage_id: tuple(
                d for d in config.stages if s.stage_id in d.input_sources and d.engine_args.chunk_size
            )
            for s in config.stages
        }
        self.started_at = time.time()
        self.ray_address: str | None = None  # the Ray cluster the stages run on (None: this process)

    # construction ---------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: PipelineConfig,
        model: ModelSource,
        *,
        max_pending: int = 64,
        check_devices: bool = True,
        ray_address: str | None = None,
        model_cache: Path | None = None,
    ) -> OmniEngine:
        """Load every stage in order. A failure shuts down the stages already started.

        With ``ray_address`` each stage runs as Ray actors on that cluster (docs/distributed.md): their
        devices are the cluster's, so this machine's GPUs are not checked, and every stage's actors start
        loading at once.
        """
        if check_devices and ray_address is None:
            problems = device_problems(config)
            if problems:
                raise DeployConfigError(problems)
        if model.path is None:
            raise EngineBuildError(
                f"model {model.name} has no files yet; call engine.models.materialize first"
            )
        runners: dict[int, StageRunner] = {}
        stage = config.stages[0]
        try:
            create = runner_factory(config, model, ray_address, model_cache)
            for stage in config.stages:
                # Output names are parsed here too (not only in validation): a config built in code
                # bypasses the loader, and an invalid name must fail before any request is accepted.
                parse_output_modalities(stage.engine_output_type)
                runners[stage.stage_id] = create(stage)
            problems = chunking_problems(config, runners)
            if problems:
                raise DeployConfigError(problems)
            for stage in config.stages:
                runners[stage.stage_id].load()
        except Exception as exc:
            for runner in runners.values():
                runner.close()
            if isinstance(exc, DeployConfigError):
                raise
            raise EngineBuildError(f"stage {stage.stage_id} ({stage.kind}) failed to start: {exc}") from exc
        engine = cls(config, model, runners, max_pending=max_pending)
        engine.ray_address = ray_address
        return engine

    # requests ---------------------------------------------------------------------------------

    @property
    def config_hash(self) -> str:
        return self.config.config_hash()

    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        """Check a request and decide its parameters (raises :class:`engine.request.RequestError`).

        Parameters outside what the model's card supports do not fail: they become ``warnings``.
        """
        resolved = self.family.resolve_request(request, self.config)
        self.family.check_voice(resolved, self.model.path, self.config.model_name)
        warnings = self.card.check(self.config.model_name, resolved.parameters)
        warnings += self.card.check_text(self.config.model_name, request.prompt, request.speak_text)
        return replace(resolved, warnings=warnings) if warnings else resolved

    @functools.cached_property
    def card(self) -> ModelCard:
        """What the model supports (sizes, steps, an example prompt); empty when it declares nothing."""
        try:
            return model_card(self.model)
        except ValueError as exc:  # a broken card must not stop serving: log it and declare nothing
            log.warning("ignoring the model card: %s", exc)
            return ModelCard()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def queue_depths(self) -> dict[int, int]:
        return {sid: w.depth + w.active for sid, w in self.workers.items()}

    def decode_paths(self) -> dict[int, str]:
        """How each AR stage's decode batches on this machine, in words (stages that say)."""
        return {sid: path for sid, runner in self.runners.items() if (path := runner.decode_path) is not None}

    def waiting_depths(self) -> dict[int, int]:
        """Jobs waiting (not yet running) per stage."""
        return {sid: w.depth for sid, w in self.workers.items()}

    def position(self, request_id: str) -> int | None:
        """How many jobs are ahead of the request's waiting job: those running at its stage plus those
        queued before it. ``None`` when the request is not waiting (running, finished or unknown)."""
        positions = self.queue_positions().get(request_id)
        return min(positions.values()) if positions else None

    def queue_positions(self) -> dict[str, dict[int, int]]:
        """request id -> {stage id: jobs ahead of it} for every waiting request (its first waiting job)."""
        positions: dict[str, dict[int, int]] = {}
        for stage_id, worker in self.workers.items():
            with worker.cond:
                running = worker.active
                for index, ticket in enumerate(worker.fair_order()):  # the order it will be served in
                    positions.setdefault(ticket.handle.request_id, {}).setdefault(stage_id, running + index)
        return positions

    def check_context(self, resolved: ResolvedRequest) -> None:
        """Refuse a prompt longer than an entry AR stage's context before it is queued:
        :class:`RequestError` naming ``prompt`` (engine/context_check.py)."""
        check_context(self.config, self.runners, resolved)

    def submit(self, resolved: ResolvedRequest, sink: EventSink) -> RequestHandle:
        """Queue a request; its events go to ``sink`` (called from engine threads)."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine has been shut down")
            if len(self._handles) >= self.max_pending:
                raise EngineBusy(f"{len(self._handles)} requests in flight (limit {self.max_pending})")
            if resolved.request_id in self._handles:  # its events, cancel and fair share are per id
                raise RequestError(
                    "request_id", f"a request with id {resolved.request_id} is already in flight"
                )
            handle = RequestHandle(resolved, sink, self.config.stages_for(resolved.modalities))
            self._handles[handle.request_id] = handle
            self.client_load.add(handle.client)
            for variant in handle.variants:
                for stage in [s for s in self.config.entry_stages if s.stage_id in handle.stages]:
                    self._enqueue(handle, variant, stage)
        return handle

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: its waiting jobs leave the queues at once (the request ends now if none of
        its jobs is running); a running job stops at its runner's next check (a token, a step)."""
        with self._lock:
            handle = self._handles.get(request_id)
            if handle is None:
                return False
            self._stop(handle)
            dropped: list[Ticket] = []
            for worker in self.workers.values():
                with worker.cond:
                    keep = [t for t in worker.queue if t.handle is not handle]
                    dropped += [t for t in worker.queue if t.handle is handle]
                    worker.queue[:] = keep
            now = time.time()
            for ticket in dropped:
                self._job_done(ticket, StageStatus.CANCELLED, None, now, now, 1)
        return True

    async def generate(self, resolved: ResolvedRequest, progress: bool = True) -> AsyncIterator[EngineEvent]:
        """Run a request, yielding its events; closing the iterator early cancels the request.

        ``progress=False`` leaves out token/step progress and text deltas (a caller that only wants the
        result): they are dropped on the engine's thread, so the event loop is not woken for each one.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(event: EngineEvent) -> None:
            if progress or not isinstance(event, STREAMING_EVENTS):
                loop.call_soon_threadsafe(events.put_nowait, event)

        handle = self.submit(resolved, sink)
        finished = False
        try:
            while True:
                event = await events.get()
                yield event
                if isinstance(event, TERMINAL_EVENTS):
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel(handle.request_id)

    def stream(self, resolved: ResolvedRequest) -> Iterator[EngineEvent]:
        """Blocking counterpart of :meth:`generate` (for the CLI and scripts)."""
        events: queue.Queue[EngineEvent] = queue.Queue()
        handle = self.submit(resolved, events.put)
        finished = False
        try:
            while True:
                event = events.get()
                yield event
                if isinstance(event, TERMINAL_EVENTS):
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel(handle.request_id)

    def run(self, request: GenerationRequest) -> RunFinished:
        """Run a request to the end; raises ``RuntimeError`` with the engine's message if it fails."""
        for event in self.stream(self.resolve(request)):
            if isinstance(event, RunFinished):
                return event
            if isinstance(event, RunFailed):
                raise RuntimeError(event.message)
        raise RuntimeError("the request ended without a result")  # pragma: no cover

    # routing (called from worker threads) -------------------------------------------------------

    def _stage_params(self, handle: RequestHandle, variant: Variant, stage: ResolvedStage) -> dict[str, Any]:
        params = dict(handle.resolved.stage_params[stage.stage_id])
        params["seed"] = variant.seed
        return params

    def _hand_off(
        self, stage: ResolvedStage, upstream: Mapping[str, Any], params: dict[str, Any]
    ) -> dict[str, Any]:
        """The stage's inputs from its sources' outputs: through its input processor, if it has one."""
        if stage.input_processor:
            return INPUT_PROCESSORS[stage.input_processor](upstream, params)
        return dict(upstream)

    def _enqueue(
        self, handle: RequestHandle, variant: Variant, stage: ResolvedStage, feed: ChunkFeed | None = None
    ) -> None:
        """Queue the variant's job at ``stage``: its inputs from its sources' outputs, or, for a stage that
        consumes its source in chunks, the ``feed`` those outputs arrive through (engine/streaming.py)."""
        request = handle.resolved.request
        params = self._stage_params(handle, variant, stage)
        inputs: dict[str, Any] = {
            "prompt": request.prompt,
            "messages": request.messages,
            "image": request.image,
        }
        if feed is not None:
            inputs[CHUNK_FEED_KEY] = feed
        elif stage.input_sources:
            upstream: dict[str, Any] = {}
            for source in stage.input_sources:
                upstream.update(variant.outputs[source])
            inputs.update(self._hand_off(stage, upstream, params))
        job = StageJob(
            request_id=handle.request_id,
            index=variant.index,
            inputs=inputs,
            params=params,
            emit=handle.emit,
            accumulator=OutputAccumulator(self._modalities[stage.stage_id]),
            cancel_event=handle.cancel_event,
            client=handle.client,
        )
        consumers = [d for d in self._chunked_consumers[stage.stage_id] if d.stage_id in handle.stages]
        if consumers:  # its runner hands its outputs so far to them as it generates
            job.scratch[PUBLISH_KEY] = functools.partial(self._publish, handle, variant, tuple(consumers))
        variant.jobs[stage.stage_id] = job
        self.workers[stage.stage_id].submit(Ticket(job, handle, variant, stage, time.time()))

    def _publish(
        self,
        handle: RequestHandle,
        variant: Variant,
        consumers: tuple[ResolvedStage, ...],
        outputs: Mapping[str, Any],
    ) -> None:
        """A source's outputs so far (on its runner's thread, after each token): hand them to the stages
        that consume it in chunks, queueing each one's job at the first publication."""
        for stage in consumers:
            try:
                inputs = self._hand_off(stage, outputs, self._stage_params(handle, variant, stage))
            except Exception:  # a partial output the hand-off cannot take: the final hand-off reports it
                continue
            self._feed(handle, variant, stage, inputs, final=False)

    def _feed(
        self,
        handle: RequestHandle,
        variant: Variant,
        stage: ResolvedStage,
        inputs: dict[str, Any],
        final: bool,
    ) -> None:
        with self._lock:
            if handle.terminal is not None or handle.cancel_event.is_set():
                return
            feed = variant.feeds.get(stage.stage_id)
            if feed is None:
                feed = variant.feeds[stage.stage_id] = ChunkFeed()
                feed.publish(inputs, final=final)
                self._enqueue(handle, variant, stage, feed=feed)
                return
        feed.publish(inputs, final=final)

    def _stop(self, handle: RequestHandle) -> None:
        """Cancel the request's running jobs and wake the stages waiting on its chunk feeds."""
        handle.cancel()
        for variant in handle.variants:
            for feed in variant.feeds.values():
                feed.close()

    def _job_started(self, ticket: Ticket, started: float) -> None:
        stage, job = ticket.stage, ticket.job
        if stage.kind == "ar":
            total = int(job.params.get("max_tokens") or 0)
        elif stage.engine_args.chunk_size:
            total = 0  # its chunks are counted as its source generates
        else:
            total = int(job.params.get("num_inference_steps") or 0)
        job.scratch["queue_seconds"] = started - ticket.enqueued_at
        job.emit(StageStarted(job.request_id, job.index, stage.stage_id, kind=stage.kind, total=total))

    def _job_done(
        self,
        ticket: Ticket,
        status: StageStatus,
        error: Exception | None,
        started: float,
        finished: float,
        batch_size: int,
    ) -> None:
        handle, variant, stage, job = ticket.handle, ticket.variant, ticket.stage, ticket.job
        handle.emit(
            StageFinished(
                handle.request_id,
                variant.index,
                stage.stage_id,
                kind=stage.kind,
                status=status,
                started_at=started,
                finished_at=finished,
                queue_seconds=float(job.scratch.get("queue_seconds", max(0.0, started - ticket.enqueued_at))),
                input_tokens=job.input_tokens,
                output_tokens=job.output_tokens,
                batch_size=batch_size,
                step_rows=int(job.scratch.get("step_rows", 0)),
            )
        )
        with self._lock:
            if handle.terminal is not None:
                return
            if status == StageStatus.CANCELLED:
                self._finish(
                    handle,
                    RunFailed(
                        handle.request_id,
                        variant.index,
                        "the request was cancelled",
                        stage.stage_id,
                        ErrorType.CANCELLED,
                        True,
                    ),
                )
                return
            if status == StageStatus.FAILED:
                self._stop(handle)  # stop the request's other variants
                message = f"stage {stage.stage_id} ({stage.kind}) failed: {type(error).__name__}: {error}"
                error_type = (
                    ErrorType.INVALID_REQUEST if isinstance(error, RequestError) else ErrorType.ENGINE_ERROR
                )
                self._finish(
                    handle, RunFailed(handle.request_id, variant.index, message, stage.stage_id, error_type)
                )
                return
            variant.outputs[stage.stage_id] = job.deliver_outputs()
            try:
                for downstream in [s for s in self.config.stages if s.stage_id in handle.stages]:
                    if stage.stage_id not in downstream.input_sources or not all(
                        src in variant.outputs for src in downstream.input_sources
                    ):
                        continue
                    if downstream.engine_args.chunk_size:  # the source's final outputs, through its feed
                        params = self._stage_params(handle, variant, downstream)
                        inputs = self._hand_off(downstream, variant.outputs[stage.stage_id], params)
                        self._feed(handle, variant, downstream, inputs, final=True)
                    else:
                        self._enqueue(handle, variant, downstream)
            except Exception as exc:  # an input processor rejected the hand-off
                self._stop(handle)
                message = f"stage {stage.stage_id} -> next stage hand-off failed: {type(exc).__name__}: {exc}"
                self._finish(handle, RunFailed(handle.request_id, variant.index, message, stage.stage_id))
                return
            if all(sid in variant.outputs for sid in handle.stages):
                variant.done = True
            if all(v.done for v in handle.variants):
                outputs = tuple(
                    run_output(self.config, handle.resolved.modalities, v) for v in handle.variants
                )
                self._finish(handle, RunFinished(handle.request_id, 0, outputs))

    def _finish(self, handle: RequestHandle, event: EngineEvent) -> None:
        handle.terminal = event
        if self._handles.pop(handle.request_id, None) is not None:
            self.client_load.remove(handle.client)
        handle.emit(event)

    # shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers, fail what is still in flight, release the models."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.values())
        for handle in handles:
            self._stop(handle)
        for worker in self.workers.values():
            worker.stop()
        for worker in self.workers.values():
            for thread in worker.threads:
                thread.join(timeout=30)
        with self._lock:
            for handle in handles:
                if handle.terminal is None:
                    self._finish(
                        handle,
                        RunFailed(
                            handle.request_id,
                            0,
                            "the engine was shut down",
                            None,
                            ErrorType.ENGINE_ERROR,
                            True,
                        ),
                    )
        for runner in self.runners.values():
            runner.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> OmniEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_engine(
    model: str | None = None,
    deploy_config: DeployConfig | dict | str | Path | None = None,
    *,
    data_dir: Path | None = None,
    ar_backend: str | None = None,
    max_pending: int = 64,
    ray_address: str | None = None,
    devices: str | None = None,
) -> OmniEngine:
    """Resolve ``model``, validate ``deploy_config`` against it, build the model if built in, start.

    ``ray_address`` (``--ray-address``; else the deploy config's ``ray.address``) runs each stage as Ray
    actors on that cluster (docs/distributed.md); without either the engine runs in this process.
    """
    source = describe_model(model)
    config = build_pipeline_config(source, deploy_config, ar_backend, devices)  # validated before loading
    address = ray_address or (config.ray.address if config.ray is not None else None)
    if config.ray is not None and not address:
        raise DeployConfigError(
            [
                ConfigProblem(
                    None,
                    "ray.address",
                    "the ray section needs an address ('auto', 'HOST:6379' or 'ray://HOST:10001'), "
                    "or pass --ray-address",
                )
            ]
        )
    cache = model_cache_dir(Path(data_dir) if data_dir else default_data_dir())
    source = materialize(source, cache)
    return OmniEngine.start(config, source, max_pending=max_pending, ray_address=address, model_cache=cache)


def engine_placement(engine: OmniEngine) -> dict[int, list[dict[str, Any]]]:
    """Where each stage runs, for stages outside this process: per stage, its Ray replicas or its own
    process (name, node, pid, load); empty when every stage runs in this process."""
    return {sid: runner.placement() for sid, runner in engine.runners.items() if hasattr(runner, "placement")}
