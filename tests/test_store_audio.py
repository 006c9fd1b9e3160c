"""Spoken runs in the run store (docs/speech.md "Runs, files and the CLI"): the WAV a run keeps (its sha256,
mime, decoded samples and recipe), the run's TTFP, audio seconds and real-time factor, `history show`,
bundles, and `GET /v1/outputs/<sha>.wav`. Real engine: the built-in tiny-qwen-omni."""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile
from fastapi.testclient import TestClient

from engine import GenerationParams, GenerationRequest, OmniEngine, build_engine
from engine.events import RunFinished, RunOutput
from studio.api.app import create_app
from studio.api.state import ServingOptions, ServingState
from studio.cli import main
from studio.media.audio import pcm16, read_audio_recipe
from studio.runs.service import RunService
from studio.store import RunRecorder, RunStore, export_bundle, import_bundle, open_store
from studio.store.records import RunDetail
from tests.conftest import tiny_deploy

pytest_plugins = ["conftest_store"]

PROMPT = "say hello"
RATE = 24000


@pytest.fixture(scope="module")
def omni(session_data_dir: Path) -> Iterator[OmniEngine]:
    engine = build_engine("tiny-qwen-omni", tiny_deploy("tiny-qwen-omni"), data_dir=session_data_dir)
    yield engine
    engine.close()


def speak(
    omni: OmniEngine,
    recorder: RunRecorder,
    store: RunStore,
    *,
    seed: int = 3,
    voice: str | None = "Ethan",
    streamed: bool = True,
) -> tuple[RunFinished, RunDetail]:
    """One spoken run through the run service, as the CLI (streamed events) or the API's whole responses
    (``streamed=False``: no progress events reach the caller) run it; the terminal event and the record."""
    runs = RunService(recorder, "cli", store.files)
    resolved = runs.resolve(omni, GenerationRequest(PROMPT, GenerationParams(seed=seed, voice=voice)))
    tracker = runs.start(omni, resolved, "tiny-qwen-omni", None, {"prompt": PROMPT})
    if streamed:
        terminal = runs.run_blocking(omni, resolved, tracker)
    else:
        terminal = asyncio.run(runs.run_to_end(omni, resolved, tracker, stopped="test"))
    assert isinstance(terminal, RunFinished), terminal
    assert recorder.flush(60)
    return terminal, store.get_run(tracker.run_id)


def test_a_spoken_run_keeps_its_wav_and_figures(omni, recorder, store) -> None:
    finished, run = speak(omni, recorder, store)
    [made] = finished.outputs
    assert made.audio is not None and made.audio.size > 0
    [audio] = run.audio
    data = audio.path.read_bytes()
    # Content-addressed like a PNG: the name is the sha256 of the bytes, the mime is WAV's.
    assert (audio.kind, audio.mime, audio.index) == ("audio", "audio/wav", 0)
    assert audio.sha256 == hashlib.sha256(data).hexdigest() and audio.size_bytes == len(data)
    assert audio.path.name == f"{audio.sha256}.wav"
    # The file is the engine's samples as 16-bit PCM at 24 kHz, audible.
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and audio.sample_rate == RATE
    assert np.array_equal(samples, pcm16(made.audio))
    assert np.abs(samples).max() > 300  # not silence (> 1% of full scale)
    assert audio.duration_seconds == pytest.approx(len(samples) / RATE)
    # It carries the run's recipe, as PNGs do: what decides the samples, no run id.
    recipe = read_audio_recipe(data)
    assert recipe is not None
    assert recipe["request"]["prompt"] == PROMPT and recipe["model"] == "tiny-qwen-omni"
    assert recipe["parameters"]["voice"] == "Ethan" and recipe["parameters"]["seed"] == 3
    assert recipe["config_hash"] == run.config_hash and run.id not in data.decode("latin-1")
    # The text reply is kept beside it.
    assert run.text == made.text and [o.kind for o in run.outputs] == ["audio", "text"]
    # The figures: audio seconds as stored, TTFP within the run, generation time / audio seconds.
    assert run.audio_seconds == pytest.approx(audio.duration_seconds)
    assert run.ttfp_seconds is not None and run.realtime_factor is not None
    generation = run.realtime_factor * run.audio_seconds
    assert 0 < run.ttfp_seconds <= generation + 1e-9
    assert run.realtime_factor > 0


def test_the_same_request_and_seed_is_one_file(omni, recorder, store) -> None:
    _, first = speak(omni, recorder, store, seed=5)
    _, again = speak(omni, recorder, store, seed=5)
    _, other = speak(omni, recorder, store, seed=5, voice="Chelsie")
    assert first.id != again.id
    assert first.audio[0].sha256 == again.audio[0].sha256  # same samples and recipe: same bytes
    assert other.audio[0].sha256 != first.audio[0].sha256


def test_a_caller_without_a_stream_gets_its_first_audio_at_the_end(omni, recorder, store) -> None:
    """The API's whole (non-streamed) responses see no AudioDelta: their first audio is the finished run."""
    _, run = speak(omni, recorder, store, streamed=False)
    assert run.audio and run.audio_seconds is not None and run.realtime_factor is not None
    assert run.ttfp_seconds is not None
    assert math.isclose(run.ttfp_seconds, run.realtime_factor * run.audio_seconds, rel_tol=1e-9)


def test_a_reply_with_nothing_to_speak_keeps_no_file(omni, recorder, store) -> None:
    runs = RunService(recorder, "cli", store.files)
    resolved = runs.resolve(omni, GenerationRequest(PROMPT, GenerationParams(seed=1)))
    tracker = runs.start(omni, resolved, "tiny-qwen-omni", None, {"prompt": PROMPT})
    silent = RunOutput(index=0, seed=1, text=".", audio=np.zeros(0, np.float32), sample_rate=RATE)
    tracker.observe(RunFinished(resolved.request_id, 0, (silent,)))
    assert recorder.flush(60)
    run = store.get_run(tracker.run_id)
    assert run.status == "succeeded" and run.audio == [] and run.text == "."
    assert (run.audio_seconds, run.ttfp_seconds, run.realtime_factor) == (0.0, None, None)


def test_a_text_only_run_has_no_audio_figures(omni, recorder, store) -> None:
    from engine.modality import OutputModality

    runs = RunService(recorder, "cli", store.files)
    request = GenerationRequest(PROMPT, GenerationParams(seed=2), modalities=(OutputModality.TEXT,))
    resolved = runs.resolve(omni, request)
    tracker = runs.start(omni, resolved, "tiny-qwen-omni", None, {"prompt": PROMPT})
    assert isinstance(runs.run_blocking(omni, resolved, tracker), RunFinished)
    assert recorder.flush(60)
    run = store.get_run(tracker.run_id)
    assert run.audio == [] and [o.kind for o in run.outputs] == ["text"]
    assert (run.audio_seconds, run.ttfp_seconds, run.realtime_factor) == (None, None, None)
    assert [s.stage_id for s in run.stages] == [0]  # the thinker alone


def test_history_show_lists_the_audio_with_its_length(
    omni, recorder, store, db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    _, run = speak(omni, recorder, store)
    [audio] = run.audio
    assert main(["history", "show", run.id[:12], "--db", db_url, "--data-dir", str(data_dir)]) == 0
    shown = capsys.readouterr().out
    row = re.search(rf"^\s+audio\s+0\s+(\S+) 24kHz\s+[\d.]+ KB\s+{audio.sha256[:12]}\s+(\S+)$", shown, re.M)
    assert row is not None, shown
    assert row.group(1) == f"{audio.duration_seconds:.2f}s" and row.group(2) == str(audio.path)
    figures = re.search(
        r"^\s+audio\s+([\d.]+)s made, first audio after ([\d.]+)s \(TTFP\), real-time factor ([\d.]+)$",
        shown,
        re.M,
    )
    assert figures is not None, shown
    assert float(figures.group(1)) == pytest.approx(run.audio_seconds, abs=0.005)
    assert float(figures.group(2)) == pytest.approx(run.ttfp_seconds, abs=0.0005)
    assert float(figures.group(3)) == pytest.approx(run.realtime_factor, abs=0.0005)
    assert main(["history", "show", run.id[:12], "--json", "--db", db_url, "--data-dir", str(data_dir)]) == 0
    body = capsys.readouterr().out
    assert f'"duration_seconds": {audio.duration_seconds}' in body and '"ttfp_seconds": ' in body


def test_a_bundle_carries_audio_runs(omni, recorder, store, tmp_path: Path) -> None:
    _, run = speak(omni, recorder, store, seed=7)
    [audio] = run.audio
    bundle = tmp_path / "runs.zip"
    assert export_bundle(store, bundle) == 1
    with zipfile.ZipFile(bundle) as archive:
        assert archive.read(f"files/{audio.sha256}.wav") == audio.path.read_bytes()
    elsewhere = tmp_path / "elsewhere"
    with open_store(f"sqlite:///{tmp_path / 'other.db'}", elsewhere) as other:
        result = import_bundle(other, bundle)
        assert (result.imported, result.skipped) == (1, 0)
        copy = other.get_run(run.id)
    [moved] = copy.audio
    assert moved.path.is_relative_to(elsewhere) and moved.path.read_bytes() == audio.path.read_bytes()
    assert (moved.sha256, moved.mime, moved.duration_seconds, moved.sample_rate) == (
        audio.sha256,
        "audio/wav",
        audio.duration_seconds,
        RATE,
    )
    assert (copy.ttfp_seconds, copy.audio_seconds, copy.realtime_factor) == (
        run.ttfp_seconds,
        run.audio_seconds,
        run.realtime_factor,
    )


def test_outputs_route_serves_the_wav(omni, recorder, store, data_dir: Path) -> None:
    _, run = speak(omni, recorder, store)
    [audio] = run.audio
    client = TestClient(create_app(ServingState(None, ServingOptions(data_dir=data_dir))))
    response = client.get(f"/v1/outputs/{audio.sha256}.wav")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav"
    assert response.content == audio.path.read_bytes()
    samples, rate = soundfile.read(io.BytesIO(response.content))
    assert rate == RATE and len(samples) / RATE == pytest.approx(audio.duration_seconds)
    # Only the stored file's own name: another extension, or a text output, is not a file it serves.
    text = next(o for o in run.outputs if o.kind == "text")
    for name in (f"{audio.sha256}.flac", f"{audio.sha256}.png", f"{text.sha256}.txt", f"{audio.sha256}.WAV"):
        missing = client.get(f"/v1/outputs/{name}")
        assert missing.status_code == 404, name
        assert missing.json()["error"]["param"] == "name"


def test_a_signed_url_serves_the_wav_without_the_key(omni, recorder, store, data_dir: Path) -> None:
    _, run = speak(omni, recorder, store)
    name = f"{run.audio[0].sha256}.wav"
    state = ServingState(None, ServingOptions(api_key="k", data_dir=data_dir))
    client = TestClient(create_app(state))
    assert client.get(f"/v1/outputs/{name}").status_code == 403  # a key is set: signed or with the key
    signed = client.get(f"/v1/outputs/{name}?{state.signer.query(name, 60)}")
    assert signed.status_code == 200 and signed.headers["content-type"] == "audio/wav"
    assert signed.content == run.audio[0].path.read_bytes()
    other = f"{run.audio[0].sha256}.png"  # a signature covers its own name only
    assert client.get(f"/v1/outputs/{other}?{state.signer.query(name, 60)}").status_code == 403


def test_journaled_audio_writes_replay_with_their_figures(store, data_dir: Path) -> None:
    """A spoken run's writes that the database refused are journaled as JSON and replayed later
    (studio/store/journal.py): the WAV's length and the run's figures come through."""
    import json

    from studio.store.journal import apply_entries

    wav_sha = store.write_file(b"RIFF....WAVE", "audio/wav")[0]
    run_id = store.create_run(source="api", prompt=PROMPT, model="tiny-qwen-omni", request={}, parameters={})
    output = {
        "run_id": run_id,
        "index": 0,
        "mime": "audio/wav",
        "width": None,
        "height": None,
        "duration_seconds": 1.2,
        "sample_rate": RATE,
        "sha256": wav_sha,
        "size_bytes": 12,
    }
    figures = {"ttfp_seconds": 0.25, "audio_seconds": 1.2, "realtime_factor": 0.5}
    finish = {"run_id": run_id, "status": "succeeded", "at": 1.0, "audio": figures}
    # What the journal file holds, replayed twice (a crash between its commit and its removal).
    entries = json.loads(
        json.dumps(
            [
                {"run": run_id, "op": "add_output_file", "args": output},
                {"run": run_id, "op": "finish_run", "args": finish},
            ]
        )
    )
    assert apply_entries(store, entries, None) == [] and apply_entries(store, entries, None) == []
    run = store.get_run(run_id)
    [audio] = run.audio
    assert (audio.sha256, audio.duration_seconds, audio.sample_rate) == (wav_sha, 1.2, RATE)
    assert (run.status, run.ttfp_seconds, run.audio_seconds, run.realtime_factor) == (
        "succeeded",
        0.25,
        1.2,
        0.5,
    )
