"""Replaying recorded runs: the same request, parameters and seed again, on the running engine or another
model / deploy config, recorded as new runs linked to their originals, and compared output by output.

``omni-studio replay`` (:mod:`studio.cli.replay`) and the History tab's replay action
(:mod:`studio.ui.history`) both call :class:`Replayer`. A replay goes through the one run path
(:class:`studio.runs.service.RunService`), so it is recorded like any run; its ``replay_of`` column names the
original. The comparison reads what the run store recorded for both runs (:mod:`studio.replay.report`).

What a replay sends: the original's prompt, chat history, source image and output modalities, its seed,
and its request-level parameters as they were resolved (size, steps, guidance, negative prompt,
temperature, top-p/top-k, n; ``max_tokens`` for chat and speech models; a spoken run's voice, speed and
the text it was given to say, ``speak_text``). With ``parameters="config"`` those the original took from
its config's defaults follow the target config's defaults instead. A run that heard audio clips cannot be
replayed: the store keeps how many there were, not their samples. docs/replay.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.config import PipelineConfig
from engine.config.deploy import TOPOLOGY_KEYS
from engine.modality import OutputModality
from engine.request import ChatTurn, GenerationParams, GenerationRequest, RequestError, ResolvedRequest
from studio.replay.report import (
    PARAMETER_MODES,
    ReplayEntry,
    compare_runs,
    failed_entry,
)
from studio.runs.service import RunRejected, RunService, RunTracking
from studio.store import ACTIVE_STATUSES, AmbiguousRunId, RunDetail, RunFilter, RunNotFound, RunStore

if TYPE_CHECKING:
    from engine import OmniEngine
    from studio.store.recorder import RunRecorder

# Parameters a request can set (engine.request.GenerationParams); the rest of a run's resolved parameters
# come from its pipeline config, and so from the config a replay runs on.
REQUEST_KEYS = (
    "seed",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "voice",  # speech (docs/speech.md): the speaker and the tempo
    "speed",
)
# GLM-Image's AR budget follows from the size; a chat model's and a speech model's thinker's do not.
CHAT_REQUEST_KEYS = ("max_tokens",)
CHAT_FAMILIES = ("chat", "qwen-omni")
DEFAULT_LIMIT = 50
RECORD_TIMEOUT_S = 60.0  # waiting for the recorder to write a finished replay before comparing it


class ReplaySelectionError(ValueError):
    """The runs asked for cannot be replayed (unknown or ambiguous id, a run still in progress)."""


class ReplayInputError(ValueError):
    """A recorded run cannot be turned back into a request (its source image file is gone)."""


# -- the request a replay sends --------------------------------------------------------------------


def stage_defaults(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A pipeline config's default sampling parameters, flat (the first stage that sets a key wins, as in
    a run's recorded ``parameters``); ``config`` is a ``PipelineConfig.to_dict()`` or a run's snapshot."""
    defaults: dict[str, Any] = {}
    for stage in (config or {}).get("stages") or []:
        for key, value in (stage.get("default_sampling_params") or {}).items():
            defaults.setdefault(key, value)
    return defaults


@dataclass(frozen=True)
class ReplayRequest:
    """The request that replays a run, the request fields it gives, and notes on the parameters chosen."""

    request: GenerationRequest
    fields: dict[str, Any]
    notes: tuple[str, ...] = ()


def request_for_replay(
    detail: RunDetail, config: PipelineConfig, parameters: str = "recorded"
) -> ReplayRequest:
    """The request that reproduces ``detail`` on a pipeline with ``config``: same prompt, chat history,
    source image, modalities, seed and request-level parameters.

    ``parameters="config"``: a parameter whose recorded value is the original config's default (the
    original did not ask for another) takes ``config``'s default where that differs. With
    ``"recorded"`` such differences are kept and named in the notes. Raises :class:`ReplayInputError` when
    the original's source image file is gone.
    """
    from PIL import Image, UnidentifiedImageError

    if parameters not in PARAMETER_MODES:
        raise ValueError(f"parameters must be one of {', '.join(PARAMETER_MODES)}, got {parameters!r}")
    recorded = dict(detail.parameters)
    keys = REQUEST_KEYS + (CHAT_REQUEST_KEYS if config.family in CHAT_FAMILIES else ())
    fields = {key: recorded.get(key) for key in keys}
    notes = []
    original_defaults, target_defaults = stage_defaults(detail.config), stage_defaults(config.to_dict())
    for key in keys:
        value = fields[key]
        if key in ("seed", "n") or value is None:
            continue
        if original_defaults.get(key) != value or key not in target_defaults:
            continue  # the original asked for this value, or the target config has no default for it
        if target_defaults[key] == value:
            continue
        if parameters == "config":
            fields[key] = None  # resolved from the target config's default
            notes.append(f"{key}: {value} -> {target_defaults[key]} (the target config's default)")
        else:
            notes.append(
                f"{key} kept at {value} as recorded; the target config's default is {target_defaults[key]} "
                "(replay with parameters 'config' to use it)"
            )
    clips = recorded.get("input_audio_clips")
    if clips:
        raise ReplayInputError(
            f"run {detail.id} heard {clips} audio clip(s) (input_audio); the run store keeps how many, not "
            "their samples, so it cannot be replayed"
        )
    image = None
    source = next((o for o in detail.outputs if o.kind == "source"), None)
    if source is not None:
        try:
            with Image.open(source.path) as opened:
                image = opened.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise ReplayInputError(f"the source image of run {detail.id} cannot be read: {exc}") from exc
    history: tuple[ChatTurn, ...] = ()
    messages = (detail.request or {}).get("messages")
    if isinstance(messages, list) and len(messages) > 1:
        history = tuple(
            ChatTurn(m.get("role", "user"), m["content"])
            for m in messages[:-1]
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    modalities = tuple(OutputModality(m) for m in recorded.get("modalities") or []) or None
    params = GenerationParams(
        seed=fields["seed"],
        height=fields["height"],
        width=fields["width"],
        num_inference_steps=fields["num_inference_steps"],
        guidance_scale=fields["guidance_scale"],
        negative_prompt=fields["negative_prompt"],
        max_tokens=fields.get("max_tokens"),
        temperature=fields["temperature"],
        top_p=fields["top_p"],
        top_k=fields["top_k"],
        n=fields["n"] or 1,
        voice=fields["voice"],
        speed=fields["speed"],
    )
    speak_text = recorded.get("speak_text")
    request = GenerationRequest(
        detail.prompt,
        params,
        image=image,
        history=history,
        modalities=modalities,
        speak_text=speak_text if isinstance(speak_text, str) else None,
    )
    given = {key: value for key, value in fields.items() if value is not None}
    if request.speak_text is not None:
        given["speak_text"] = request.speak_text
    return ReplayRequest(request, given, tuple(notes))


def deploy_from_snapshot(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """A deploy document that resolves to the recorded pipeline config ``snapshot`` again (every stage
    spelled out: topology, engine args, default sampling parameters), for the same model."""
    stages = []
    for stage in snapshot.get("stages") or []:
        document = {"stage_id": stage["stage_id"]}
        document.update({key: stage.get(key) for key in TOPOLOGY_KEYS})
        document.update(dict(stage.get("engine_args") or {}))
        document["default_sampling_params"] = dict(stage.get("default_sampling_params") or {})
        stages.append(document)
    return {"async_chunk": bool(snapshot.get("async_chunk")), "stages": stages}


# -- picking runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySelection:
    """The runs to replay (full records, newest first) and how they were picked, in words."""

    runs: list[RunDetail]
    description: str
    matched: int  # how many runs matched (more than ``len(runs)`` when the limit cut the list)


def describe_filter(flt: RunFilter) -> str:
    """``"status succeeded, prompt contains 'circle'"``: the filter's set fields, in words."""
    parts = []
    for name, label in (
        ("status", "status"),
        ("source", "source"),
        ("model", "model"),
        ("fingerprint", "fingerprint"),
        ("config_hash", "config hash"),
        ("output_kind", "with output"),
    ):
        value = getattr(flt, name)
        if value:
            parts.append(f"{label} {value if isinstance(value, str) else ', '.join(value)}")
    if flt.search:
        parts.append(f"prompt contains {flt.search!r}")
    for name, label in (("since", "from"), ("until", "to")):
        value = getattr(flt, name)
        if value is not None:
            parts.append(f"{label} {value}")
    if flt.replays is False:
        parts.append("not replays")
    elif flt.replays:
        parts.append("replays only")
    return ", ".join(parts) or "every run"


def select_runs(
    store: RunStore,
    filter: RunFilter | None = None,
    ids: Sequence[str] = (),
    limit: int = DEFAULT_LIMIT,
) -> ReplaySelection:
    """The runs to replay: ``ids`` (full ids or unique prefixes, in the order given), or else the newest
    ``limit`` runs matching ``filter``.

    A filter without a status picks succeeded runs, and a filter picks no replays unless it asks for them
    (``replays``), so replaying twice does not replay the replays. Runs still queued or running cannot
    be replayed. Raises :class:`ReplaySelectionError`.
    """
    if ids:
        runs: list[RunDetail] = []
        for prefix in ids:
            try:
                run_id = store.resolve_run_id(prefix)
            except (RunNotFound, AmbiguousRunId) as exc:
                raise ReplaySelectionError(str(exc)) from None
            if any(run.id == run_id for run in runs):
                continue
            detail = store.get_run(run_id)
            if detail.status in ACTIVE_STATUSES:
                raise ReplaySelectionError(f"run {run_id} is still {detail.status}; replay finished runs")
            runs.append(detail)
        return ReplaySelection(runs, f"{len(runs)} run{'s' if len(runs) != 1 else ''} by id", len(runs))
    if limit < 1:
        raise ReplaySelectionError(f"limit must be at least 1, got {limit}")
    flt = filter or RunFilter()
    statuses = [flt.status] if isinstance(flt.status, str) else list(flt.status or [])
    active = [status for status in statuses if status in ACTIVE_STATUSES]
    if active:
        raise ReplaySelectionError(
            f"status {active[0]}: runs still in progress cannot be replayed; pick finished runs "
            "(succeeded, failed, cancelled, interrupted)"
        )
    flt = replace(
        flt, status=flt.status or "succeeded", replays=False if flt.replays is None else flt.replays
    )
    try:
        summaries = store.list_runs(flt, limit=limit)
        matched = store.count_matching(flt).value
    except ValueError as exc:  # an unknown status or source
        raise ReplaySelectionError(str(exc)) from None
    runs = [store.get_run(summary.id) for summary in summaries]
    wording = describe_filter(flt)
    if matched > len(runs):
        description = f"the newest {len(runs)} of {matched:,} runs matching {wording} (limit {limit})"
    else:
        description = f"{len(runs)} run{'s' if len(runs) != 1 else ''} matching {wording}"
    return ReplaySelection(runs, description, matched)


# -- replaying ----------------------------------------------------------------------------------------


def unserved_fingerprint(original: RunDetail, config: PipelineConfig) -> str | None:
    """The fingerprint a replay records where nothing is served (the CLI): the original's, as its
    fingerprint settings would give it on ``config``.

    None stays None (mode ``none``, or a CLI run); an ``omni-studio-...-<hash8>`` value of the original's
    config is computed again for ``config`` (mode ``full``: this version and config hash); anything else is
    a custom value and stays. On the original's own config this is the original's fingerprint, so a replay
    there writes byte-identical PNGs (the PNG recipe names the fingerprint: docs/recipes.md).
    """
    from studio.api.fingerprint import FingerprintSettings, system_fingerprint

    value = original.fingerprint
    hash8 = (original.config_hash or "")[:8]
    if value is None or not hash8 or not (value.startswith("omni-studio-") and value.endswith(f"-{hash8}")):
        return value
    return system_fingerprint(FingerprintSettings("full"), config)


@dataclass(frozen=True)
class ReplayTarget:
    """What runs are replayed on: an engine, the model name replays record, and the fingerprint they
    record: the one ``engine`` is served with, or, when nothing is served (``served`` False: the CLI), each
    original's own as :func:`unserved_fingerprint` gives it."""

    engine: OmniEngine
    model_name: str
    fingerprint: str | None = None
    served: bool = True

    @property
    def config(self) -> PipelineConfig:
        return self.engine.config

    def fingerprint_for(self, original: RunDetail) -> str | None:
        return self.fingerprint if self.served else unserved_fingerprint(original, self.config)


@dataclass
class _Started:
    resolved: ResolvedRequest
    tracker: RunTracking
    notes: tuple[str, ...] = field(default_factory=tuple)


class Replayer:
    """Replays runs through a :class:`RunService` (recording them) and compares each with its original.

    ``recorder`` is the run store's recorder behind ``runs``: a replay's outputs are compared once the
    recorder has written them, from the store.
    """

    def __init__(self, runs: RunService, recorder: RunRecorder, parameters: str = "recorded") -> None:
        if parameters not in PARAMETER_MODES:
            raise ValueError(f"parameters must be one of {', '.join(PARAMETER_MODES)}, got {parameters!r}")
        self.runs = runs
        self.recorder = recorder
        self.store = recorder.store
        self.parameters = parameters

    def _start(self, original: RunDetail, target: ReplayTarget) -> _Started | ReplayEntry:
        """Build, check and record the replay's request; a refused one is recorded as a failed replay."""
        config = target.config
        fingerprint = target.fingerprint_for(original)
        payload: dict[str, Any] = {"replay_of": original.id, "parameters": self.parameters}
        try:
            replay = request_for_replay(original, config, self.parameters)
            payload.update(prompt=original.prompt, **replay.fields)
            resolved = self.runs.resolve(target.engine, replay.request)
        except (ReplayInputError, RequestError) as exc:
            error = f"replay refused: {exc}"
            run_id = self.recorder.record_rejected(
                self.runs.source,
                payload,
                error,
                target.model_name,
                config,
                fingerprint,
                replay_of=original.id,
            )
            return failed_entry(
                original,
                error,
                replay_id=run_id,
                model_after=target.model_name,
                config_hash_after=config.config_hash(),
                fingerprint_after=fingerprint,
            )
        tracker = self.runs.start(
            target.engine, resolved, target.model_name, fingerprint, payload, replay_of=original.id
        )
        return _Started(resolved, tracker, replay.notes)

    def _finish(self, original: RunDetail, started: _Started) -> ReplayEntry:
        """Wait for the recorder, then compare the recorded replay with the original."""
        run_id = started.tracker.run_id
        self.recorder.flush(RECORD_TIMEOUT_S)
        try:
            replay = self.store.get_run(run_id)
        except RunNotFound:  # the database refused the writes (they wait in the journal)
            return failed_entry(
                original, f"the replay {run_id} ran but its record cannot be read yet", replay_id=run_id
            )
        return compare_runs(original, replay, started.notes)

    async def replay(self, original: RunDetail, target: ReplayTarget) -> ReplayEntry:
        """Replay one run on an event loop (the UI); returns its report entry."""
        started = self._start(original, target)
        if isinstance(started, ReplayEntry):
            return started
        with contextlib.suppress(RunRejected):  # recorded as the replay's failure; the entry reads it
            await self.runs.run_to_end(
                target.engine, started.resolved, started.tracker, stopped="the replay was stopped"
            )
        return await asyncio.to_thread(self._finish, original, started)

    def replay_blocking(self, original: RunDetail, target: ReplayTarget) -> ReplayEntry:
        """Replay one run, blocking (the CLI); Ctrl-C records the replay as cancelled and propagates."""
        started = self._start(original, target)
        if isinstance(started, ReplayEntry):
            return started
        with contextlib.suppress(RunRejected):  # recorded as the replay's failure
            self.runs.run_blocking(
                target.engine, started.resolved, started.tracker, stopped="stopped from the terminal (Ctrl-C)"
            )
        return self._finish(original, started)

    def cannot_run(self, original: RunDetail, error: str, model_name: str | None = None) -> ReplayEntry:
        """Record a replay that has no engine to run on (it did not start) as failed, and its entry."""
        payload = {"replay_of": original.id, "parameters": self.parameters, "prompt": original.prompt}
        run_id = self.recorder.record_rejected(
            self.runs.source,
            payload,
            error,
            model_name or original.model,
            None,
            None,
            replay_of=original.id,
        )
        return failed_entry(original, error, replay_id=run_id, model_after=model_name)
