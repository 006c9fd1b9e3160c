"""Speech in ``GET /metrics`` (docs/speech.md, "Many listeners"): per model, a histogram of the time to
the first audio (TTFP), one of the real-time factor, and a counter of underruns, each watched from the
engine's events as the run service sees them.

A request's clock starts when it was queued at its first stage (the thinker's start less its queue
time). A reply sent whole (no audio deltas: a file, not a stream) is heard when it finishes. An underrun is what a listener who starts playing at the first chunk would hear: a chunk handed
out after everything before it has played out, by more than :data:`UNDERRUN_S` (shorter gaps are within
a player's buffering); playback then resumes with that chunk, as a player's does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.events import AudioDelta, EngineEvent, RunFailed, RunFinished, StageFinished, StageStarted

TTFP_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
RTF_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
UNDERRUN_S = 0.02  # a gap shorter than this is inaudible behind a player's buffer
RECENT = 1000  # replies per model the System tab's figures are taken over


def _quantile(ordered: list[float], q: float) -> float:
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


@dataclass
class _Listening:
    """One request's audio as a listener would get it."""

    started: float  # monotonic: when its first stage started
    queued: float = 0.0  # seconds it waited for that stage (known when the stage finishes)
    first_audio: float | None = None
    seconds: float = 0.0  # audio handed out so far
    playing_until: float | None = None
    underruns: int = 0


class SpeechMeter:
    """TTFP and RTF histograms and an underrun counter, labelled by model; thread-safe."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttfp = Histogram(
            "omni_studio_speech_ttfp_seconds",
            "Time from a spoken request's queueing to its first audio",
            ["model"],
            buckets=TTFP_BUCKETS,
            registry=registry,
        )
        self.rtf = Histogram(
            "omni_studio_speech_realtime_factor",
            "A spoken request's time over its audio's length (below 1: faster than real time)",
            ["model"],
            buckets=RTF_BUCKETS,
            registry=registry,
        )
        self.underruns = Counter(
            "omni_studio_speech_underruns",
            f"Gaps over {UNDERRUN_S * 1000:.0f} ms a listener of a streamed reply would hear (a chunk late)",
            ["model"],
            registry=registry,
        )
        self._requests: dict[tuple[str, int], _Listening] = {}
        self._recent: dict[str, deque[tuple[float, float, int]]] = {}  # model -> (ttfp, rtf, underruns)
        self._lock = threading.Lock()

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per model, over its last :data:`RECENT` spoken replies: how many, TTFP p50/p95, RTF p50, and
        how many of them a listener heard a gap in (the System tab)."""
        with self._lock:
            recent = {model: list(rows) for model, rows in self._recent.items()}
        out: dict[str, dict[str, float | int]] = {}
        for model, rows in recent.items():
            ttfps = sorted(r[0] for r in rows)
            rtfs = sorted(r[1] for r in rows)
            out[model] = {
                "replies": len(rows),
                "ttfp_p50_s": _quantile(ttfps, 0.5),
                "ttfp_p95_s": _quantile(ttfps, 0.95),
                "rtf_p50": _quantile(rtfs, 0.5),
                "with_underruns": sum(1 for r in rows if r[2]),
            }
        return out

    def observe(self, model: str, event: EngineEvent, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = (event.request_id, getattr(event, "index", 0))
        with self._lock:
            if isinstance(event, StageStarted) and key not in self._requests:
                self._requests[key] = _Listening(started=now)
                self.underruns.labels(model)  # shown from the first request on, 0 until one happens
                return
            listening = self._requests.get(key)
            if isinstance(event, RunFinished | RunFailed):
                self._finish(model, event, now)
                return
            if listening is None:
                return
            if isinstance(event, StageFinished) and event.stage_id == 0:
                listening.queued = event.queue_seconds
            elif isinstance(event, AudioDelta) and event.samples.size and event.sample_rate:
                self._heard(model, listening, event.samples.size / event.sample_rate, now)

    def _heard(self, model: str, listening: _Listening, seconds: float, now: float) -> None:
        if listening.first_audio is None:
            listening.first_audio = now
        if listening.playing_until is not None and now - listening.playing_until > UNDERRUN_S:
            listening.underruns += 1
            self.underruns.labels(model).inc()
        start = now if listening.playing_until is None else max(now, listening.playing_until)
        listening.playing_until = start + seconds
        listening.seconds += seconds

    def _finish(self, model: str, event: RunFinished | RunFailed, now: float) -> None:
        """The request's figures, once (every variant of it: a run's events name variant 0 only)."""
        for key in [k for k in self._requests if k[0] == event.request_id]:
            listening = self._requests.pop(key)
            if isinstance(event, RunFailed):
                continue
            if listening.first_audio is None:  # a whole-file reply (no deltas asked for): heard at the end
                listening.first_audio = now
                listening.seconds = sum(
                    o.audio.size / o.sample_rate
                    for o in event.outputs
                    if o.index == key[1] and o.audio is not None and o.sample_rate
                )
            if not listening.seconds:
                continue
            began = listening.started - listening.queued
            ttfp, rtf = listening.first_audio - began, (now - began) / listening.seconds
            self.ttfp.labels(model).observe(ttfp)
            self.rtf.labels(model).observe(rtf)
            self._recent.setdefault(model, deque(maxlen=RECENT)).append((ttfp, rtf, listening.underruns))
