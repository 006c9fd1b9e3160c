"""Spoken replies in /metrics (studio/api/speech_metrics.py): TTFP and RTF per model, and the underruns a
listener would hear, from the engine's events at given times."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from engine.events import AudioDelta, RunFailed, RunFinished, StageFinished, StageStarted
from studio.api.speech_metrics import SpeechMeter

RATE = 24000


def chunk(seconds: float, request: str = "r1") -> AudioDelta:
    return AudioDelta(request, 0, 2, np.zeros(int(seconds * RATE), dtype=np.float32), RATE)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_ttfp_rtf_and_underruns_of_one_reply():
    registry = CollectorRegistry()
    meter = SpeechMeter(registry)
    meter.observe("m", StageStarted("r1", 0, 0), now=10.0)
    meter.observe("m", StageFinished("r1", 0, 0, queue_seconds=0.5), now=10.2)  # it had waited 0.5 s
    meter.observe("m", chunk(0.48), now=10.7)  # first audio 1.2 s after it was queued
    meter.observe("m", chunk(0.48), now=11.0)  # in time: 0.48 s of audio was still playing
    meter.observe("m", chunk(0.48), now=11.7)  # late: the audio ran out at 11.66 (40 ms gap)
    meter.observe("m", chunk(0.48), now=12.19)  # in time again (playback resumed at 11.7)
    meter.observe("m", RunFinished("r1", 0), now=12.3)
    assert value(registry, "omni_studio_speech_ttfp_seconds_sum", model="m") == pytest.approx(1.2)
    assert value(registry, "omni_studio_speech_ttfp_seconds_count", model="m") == 1
    assert value(registry, "omni_studio_speech_realtime_factor_sum", model="m") == pytest.approx(2.8 / 1.92)
    assert value(registry, "omni_studio_speech_underruns_total", model="m") == 1


def test_a_gap_within_the_buffer_is_no_underrun_and_failed_runs_are_not_timed():
    registry = CollectorRegistry()
    meter = SpeechMeter(registry)
    meter.observe("m", StageStarted("r1", 0, 0), now=0.0)
    meter.observe("m", chunk(0.1), now=1.0)
    meter.observe("m", chunk(0.1), now=1.11)  # 10 ms after it ran out: under UNDERRUN_S
    meter.observe("m", RunFinished("r1", 0), now=1.2)
    meter.observe("m", StageStarted("r2", 0, 0), now=0.0)
    meter.observe("m", chunk(0.1, "r2"), now=0.5)
    meter.observe("m", RunFailed("r2", 0, message="cancelled", cancelled=True), now=0.6)
    assert value(registry, "omni_studio_speech_underruns_total", model="m") == 0
    assert value(registry, "omni_studio_speech_ttfp_seconds_count", model="m") == 1  # r1 only
    meter.observe("m", chunk(0.1, "r3"), now=0.1)  # a request never started here: ignored
    assert value(registry, "omni_studio_speech_ttfp_seconds_count", model="m") == 1


def test_a_whole_file_reply_is_heard_when_it_finishes():
    from engine.events import RunOutput

    registry = CollectorRegistry()
    meter = SpeechMeter(registry)
    meter.observe("m", StageStarted("r1", 0, 0), now=0.0)
    audio = np.zeros(RATE, dtype=np.float32)  # one second
    meter.observe(
        "m",
        RunFinished("r1", 0, outputs=(RunOutput(index=0, seed=1, audio=audio, sample_rate=RATE),)),
        now=0.5,
    )
    assert value(registry, "omni_studio_speech_ttfp_seconds_sum", model="m") == pytest.approx(0.5)
    assert value(registry, "omni_studio_speech_realtime_factor_sum", model="m") == pytest.approx(0.5)


def test_the_summary_gives_each_models_recent_figures():
    registry = CollectorRegistry()
    meter = SpeechMeter(registry)
    for i, (first, late) in enumerate([(0.2, False), (0.4, True), (0.3, False)]):
        request = f"r{i}"
        meter.observe("m", StageStarted(request, 0, 0), now=0.0)
        meter.observe("m", chunk(0.5, request), now=first)
        meter.observe("m", chunk(0.5, request), now=first + (0.6 if late else 0.3))
        meter.observe("m", RunFinished(request, 0), now=2.0)
    summary = meter.summary()["m"]
    assert summary["replies"] == 3 and summary["with_underruns"] == 1
    assert summary["ttfp_p50_s"] == 0.3 and summary["ttfp_p95_s"] == 0.4
    assert summary["rtf_p50"] == 2.0  # 2 s for 1 s of audio each
    assert meter.summary().keys() == {"m"}
