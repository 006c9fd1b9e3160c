"""The requests this process has in the engine right now: who sent them, from where, how far they are.

:class:`RequestBoard` is filled by the one run path (:class:`studio.runs.service.RunService`): a request is
added when it is handed to the engine, follows its stage events, and leaves when it ends, whatever the
source (UI, API, CLI, a job's cell). The Queue panel (``studio/runs/queue.py``) reads it next to the job
queue; the engine itself knows only request ids, never owners. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from engine.events import DiffusionStep, EngineEvent, StageFinished, StageStarted, TokenProgress


@dataclass(frozen=True)
class InFlight:
    """One request in the engine (a snapshot: the board replaces it as events arrive)."""

    request_id: str
    source: str  # ui | api | cli | job
    owner: str | None  # who may cancel it (studio/runs/queue.py): "ui-session:...", "api:ADDRESS|KEY", ...
    prompt: str
    engine: Any  # the OmniEngine it runs on (the served one, or a job's own for another model)
    started: float  # time.time() when it was handed to the engine
    stages: int = 1
    stage: int | None = None  # the stage running now (None: waiting for its first stage)
    kind: str = ""
    step: int = 0
    total: int = 0
    stages_done: int = 0
    output: str = ""  # what it makes, in words (output_of): "image 64x64", "text+audio · Chelsie"

    def progress(self) -> str:
        """``stage 1/2 · 3/8 steps`` (or ``waiting``)."""
        if self.stage is None:
            return "waiting" if not self.stages_done else f"stage {self.stages_done}/{self.stages} done"
        unit = "tokens" if self.kind == "ar" else "steps"
        # Runs that do not stream (API without stream, job cells) send no per-step events: the total only.
        counted = (
            f" · {self.step}/{self.total} {unit}"
            if self.step
            else (f" · {self.total} {unit}" if self.total else "")
        )
        return f"stage {self.stages_done + 1}/{self.stages} ({self.kind}){counted}"


def output_of(modalities: tuple[Any, ...], parameters: dict[str, Any]) -> str:
    """What a request makes, in words (the Queue panel): ``image 64x64``, ``text+audio · Chelsie · 1.5x``."""
    kinds = [str(getattr(m, "value", m)) for m in modalities]
    words = ["+".join(kinds)]
    if "audio" in kinds:
        words += [str(parameters["voice"])] if parameters.get("voice") else []
        words += [f"{float(parameters['speed']):g}x"] if parameters.get("speed") else []
    elif "image" in kinds and parameters.get("width") and parameters.get("height"):
        words[0] += f" {parameters['width']}x{parameters['height']}"
    return " · ".join(words)


class RequestBoard:
    """Requests in the engine, by request id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, InFlight] = {}

    def add(
        self, request_id: str, source: str, owner: str | None, prompt: str, engine: Any, output: str = ""
    ) -> None:
        stages = len(getattr(getattr(engine, "config", None), "stages", ()) or ()) or 1
        entry = InFlight(request_id, source, owner, prompt, engine, time.time(), stages, output=output)
        with self._lock:
            self._requests[request_id] = entry

    def observe(self, event: EngineEvent) -> None:
        """Follow a request's stage progress (other events are ignored)."""
        with self._lock:
            entry = self._requests.get(event.request_id)
            if entry is None or event.index:  # variant 0 stands for the request
                return
            if isinstance(event, StageStarted):
                entry = replace(entry, stage=event.stage_id, kind=str(event.kind), step=0, total=event.total)
            elif isinstance(event, (TokenProgress, DiffusionStep)):
                entry = replace(entry, step=event.step, total=event.total or entry.total)
            elif isinstance(event, StageFinished):
                entry = replace(entry, stage=None, stages_done=entry.stages_done + 1)
            else:
                return
            self._requests[event.request_id] = entry

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def get(self, request_id: str) -> InFlight | None:
        with self._lock:
            return self._requests.get(request_id)

    def snapshot(self) -> list[InFlight]:
        """Every request in the engine, oldest first."""
        with self._lock:
            return sorted(self._requests.values(), key=lambda entry: entry.started)
