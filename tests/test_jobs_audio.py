"""Speech jobs (docs/jobs.md, docs/speech.md): a job over prompts x seeds x voices x speed on the built-in
tiny-qwen-omni, its checks (each naming the field and what is allowed), its cells kept as WAV files in the
run store, the labelled waveform grid, a job a dead process left that the next runner finishes with one
succeeded run per cell, and what the Queue panel says each job and request makes. Real engine, in-process."""

from __future__ import annotations

import asyncio
import os
import uuid

import numpy as np
import pytest
import soundfile  # type: ignore[import-untyped]  # ships no type information
from PIL import Image

from engine.modality import OutputModality
from engine.tempo import SLACK
from studio.jobs.runner import cell_request
from studio.jobs.service import JobService
from studio.jobs.spec import JobSpec, JobSpecError, parse_job_spec
from studio.media.audio import WAVE_COLOR, pcm16
from studio.runs.inflight import RequestBoard, output_of
from studio.runs.queue import QueueView, Viewer
from studio.runs.service import RunService
from studio.startup.limits import InputLimits
from studio.store import RunFilter
from studio.store.jobs import JobStore
from tests.conftest import tiny_deploy

pytest_plugins = ["conftest_store"]

MODEL = "tiny-qwen-omni"
VOICES = ["Chelsie", "Ethan"]


@pytest.fixture(scope="module")
def omni_engine(tmp_path_factory):
    from engine import build_engine

    # The preset, with a short thinker reply: each cell speaks a fraction of a second.
    deploy = tiny_deploy(MODEL, stage0={"default_sampling_params": {"temperature": 0.8, "max_tokens": 8}})
    engine = build_engine(MODEL, deploy, data_dir=tmp_path_factory.mktemp("omni-jobs"))
    yield engine
    engine.close()


def service_for(store, recorder, engine, **kwargs) -> JobService:
    return JobService(
        store, recorder, lambda: engine, lambda: engine.model.name, data_dir=store.data_dir, **kwargs
    )


def problems_of(document, limits: InputLimits | None = None) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(document, limits)
    return {problem.field: problem.message for problem in caught.value.problems}


def wav_samples(path) -> np.ndarray:
    samples, rate = soundfile.read(path, dtype="int16")
    assert rate == 24000
    return samples


# -- the spec ------------------------------------------------------------------------------------------


def test_voice_and_speed_are_axes_and_fields_checked_naming_the_field_and_the_allowed_values():
    problems = problems_of(
        {
            "prompts": ["hi"],
            "voice": "",
            "x": {"param": "speed", "values": [1.0, 0.1, "fast"]},
            "y": {"param": "pitch", "values": [1]},
        }
    )
    assert problems["voice"] == "voice must be a voice name (the model's voices, e.g. Chelsie), got ''"
    assert problems["x.values[1]"] == "speed must be a number from 0.25 to 4 (1.0: as spoken), got 0.1"
    assert problems["x.values[2]"] == "speed must be a number from 0.25 to 4 (1.0: as spoken), got 'fast'"
    assert "'model', 'deploy', 'voice' or 'speed'" in problems["y.param"]

    problems = problems_of({"prompts": ["hi"], "speed": "fast"})
    assert problems == {"speed": "speed must be a number from 0.25 to 4 (1.0: as spoken), got 'fast'"}
    problems = problems_of({"prompts": ["hi"], "voice": "Ethan", "x": {"param": "voice", "values": VOICES}})
    assert problems["voice"].startswith("is also the x axis (x.param: voice)")

    # Words to say are held to the speech limit, not the prompt limit.
    long = problems_of({"prompts": ["a" * 50], "say": True}, InputLimits(max_speech_chars=40))
    assert long == {"prompts[0]": "is 50 characters; the limit is 40 (--max-speech-chars)"}

    spec = parse_job_spec(
        {
            "prompts": ["say hello"],
            "seeds": [1, 2],
            "x": {"param": "voice", "values": VOICES},
            "y": {"param": "speed", "values": [1, 2.5]},
        }
    )
    assert spec.cell_count() == 8
    params = spec.parameters(spec.cells()[7])
    assert (params.seed, params.voice, params.speed) == (2, "Ethan", 2.5)
    request = cell_request(params, "r" * 32)
    assert (request.params.voice, request.params.speed, request.request_id) == ("Ethan", 2.5, "r" * 32)
    assert request.speak_text is None and request.modalities is None  # the model answers the prompt
    say = parse_job_spec({"prompts": ["good night"], "say": True})
    said = cell_request(say.parameters(say.cells()[0]))
    assert said.speak_text == said.prompt and said.modalities == (OutputModality.AUDIO,)


def test_submitting_checks_voices_and_speech_fields_against_the_model(store, recorder, omni_engine):
    service = service_for(store, recorder, omni_engine)

    def refused(document) -> dict[str, str]:
        with pytest.raises(JobSpecError) as caught:
            service.submit(parse_job_spec(document), "api", None)
        return {p.field: p.message for p in caught.value.problems}

    voices = refused({"prompts": ["hi"], "x": {"param": "voice", "values": ["Chelsie", "Bob"]}})
    assert voices == {"x.values[1]": "voice tiny-qwen-omni has no voice 'Bob'; allowed: Chelsie, Ethan"}
    assert refused({"prompts": ["hi"], "voice": "Bob"})["voice"].endswith("allowed: Chelsie, Ethan")
    size = refused({"prompts": ["hi"], "size": "64x64"})["size"]
    assert "makes speech, not images" in size and "voice, speed, seed" in size
    # Speech fields on a model that makes pictures.
    speed = refused({"prompts": ["hi"], "model": "tiny-glm-shapes", "speed": 2})["speed"]
    assert "makes image, no audio" in speed
    voice = refused({"prompts": ["hi"], "model": "tiny-glm-shapes", "voice": "Ethan"})["voice"]
    assert "no audio, so it has no voices" in voice
    assert (
        "cannot produce audio" in refused({"prompts": ["hi"], "model": "tiny-glm-shapes", "say": True})["say"]
    )
    assert (
        "tiny-chat makes text, not images or audio"
        in refused({"prompts": ["hi"], "model": "tiny-chat"})["model"]
    )
    assert JobStore(store).list_jobs() == []  # nothing refused was queued


# -- running one ---------------------------------------------------------------------------------------


def test_a_speech_job_speaks_every_combination_into_the_run_store_and_draws_a_waveform_grid(
    store, recorder, omni_engine
):
    service = service_for(store, recorder, omni_engine).start()
    try:
        spec = parse_job_spec(
            {
                "name": "voices x speed",
                "prompts": ["say hello"],
                "seeds": [3, 4],
                "steps": 4,  # code2wav's ODE time points: quick on a CPU
                "x": {"param": "voice", "values": VOICES},
                "y": {"param": "speed", "values": [1.0, 2.0]},
            }
        )
        job = service.submit(spec, "api", "api:test")
        assert service.output_of(job) == "audio · voices Chelsie, Ethan"
        assert service.wait(job.id, 300)
        job = service.get(job.id)
    finally:
        service.close()
    assert (job.status, job.succeeded, job.total) == ("succeeded", 8, 8), job.error
    recorder.flush()
    pinned = JobSpec.model_validate(job.spec)
    samples: dict[tuple[int, str, float], np.ndarray] = {}
    for item in job.items:
        run = store.get_run(item.run_id)
        voice, speed = item.axes["x"]["value"], item.axes["y"]["value"]
        assert (run.status, run.source, run.request["item"], run.seed) == (
            "succeeded",
            "job",
            item.index,
            item.axes["seed"],
        )
        assert run.parameters["voice"] == voice and run.parameters["num_inference_steps"] == 4
        assert run.parameters.get("speed", 1.0) == speed
        (audio,) = run.audio
        assert audio.mime == "audio/wav" and audio.path.suffix == ".wav" and audio.duration_seconds
        samples[(item.axes["seed"], voice, speed)] = wav_samples(audio.path)
        assert run.audio_seconds == pytest.approx(audio.duration_seconds)
    # Each cell is what the same request gives alone (the WAV holds its samples as 16-bit PCM).
    for index in (0, 3):
        params = pinned.parameters(pinned.cells()[index])
        alone = omni_engine.run(cell_request(params))
        assert np.array_equal(
            samples[(params.seed, params.voice, params.speed)], pcm16(alone.outputs[0].audio).reshape(-1)
        )
    # 2x says the same utterance in half the time (engine/tempo.py: round(n / speed) + SLACK samples).
    for seed in (3, 4):
        for voice in VOICES:
            whole, fast = samples[(seed, voice, 1.0)], samples[(seed, voice, 2.0)]
            assert fast.size == round(whole.size / 2) + SLACK
    # The voice and the seed each change what is heard.
    assert not np.array_equal(samples[(3, "Chelsie", 1.0)], samples[(3, "Ethan", 1.0)])
    assert not np.array_equal(samples[(3, "Chelsie", 1.0)], samples[(4, "Chelsie", 1.0)])

    grid_run = store.get_run(job.grid_run_id)
    assert grid_run.status == "succeeded" and grid_run.outputs[0].sha256 == job.grid_sha256
    with Image.open(service.grid_path(job)) as grid:
        pixels = np.asarray(grid.convert("RGB"))
    # Two voice columns of 256 px waveforms, four rows (seed x speed) of 128 px, each drawn in the wave's
    # colour: count the columns and rows that hold it.
    wave = (pixels == np.array(WAVE_COLOR, dtype=np.uint8)).all(axis=-1)
    assert pixels.shape[1] > 2 * 256 and pixels.shape[0] > 4 * 128
    rows = np.flatnonzero(wave.any(axis=1))
    bands = 1 + int((np.diff(rows) > 1).sum())  # runs of rows with wave pixels
    assert bands == 4


def test_a_say_job_speaks_each_prompt_as_given(store, recorder, omni_engine):
    service = service_for(store, recorder, omni_engine).start()
    try:
        spec = parse_job_spec(
            {
                "prompts": ["good night"],
                "seeds": [5],
                "say": True,
                "steps": 4,
                "x": {"param": "voice", "values": VOICES},
            }
        )
        job = service.submit(spec, "ui", None)
        assert service.output_of(job) == "audio · voices Chelsie, Ethan · says the prompts"
        assert service.wait(job.id, 300)
        job = service.get(job.id)
    finally:
        service.close()
    assert job.status == "succeeded", job.error
    recorder.flush()
    for item in job.items:
        run = store.get_run(item.run_id)
        assert run.parameters["speak_text"] == "good night" and not run.text  # audio alone
        assert run.parameters["modalities"] == ["audio"] and run.request["say"] is True
        assert run.audio and run.audio[0].duration_seconds


def test_a_speech_job_a_dead_process_left_is_finished_with_one_succeeded_run_per_cell(
    store, recorder, omni_engine
):
    """Cell 0 had succeeded, cell 1 was cut off before its run was recorded, cell 2 never started: the next
    runner keeps cell 0's run, runs cell 1 again and cell 2 once, and records the grid."""
    spec = parse_job_spec(
        {
            "prompts": ["hello"],
            "seeds": [8],
            "steps": 4,
            "x": {"param": "voice", "values": VOICES},
            "y": {"param": "speed", "values": [1.0, 1.5]},
        }
    ).with_defaults(MODEL)
    jobs = JobStore(store)
    dead = f"{os.uname().nodename}|999999|1|gone"  # a worker process that no longer exists
    job = jobs.create_job(
        spec=spec.model_dump(mode="json"),
        items=[spec.axes_of(c) for c in spec.cells()],
        source="api",
        owner="api:x",
        worker=dead,
    )
    jobs.mark_running(job.id)
    # Cell 0 ran to the end in the dead process: its run is in the store, the cell still says running.
    first = uuid.uuid4().hex
    jobs.start_item(job.id, 0, first)
    runs = RunService(recorder, "job", store.files)
    resolved = runs.resolve(omni_engine, cell_request(spec.parameters(spec.cells()[0]), first))
    tracker = runs.start(omni_engine, resolved, MODEL, None, {"job": job.id, "item": 0})
    asyncio.run(runs.run_to_end(omni_engine, resolved, tracker, stopped="stopped"))
    recorder.flush()
    assert store.get_run(first).status == "succeeded"
    jobs.start_item(job.id, 1, "f" * 32)  # cut off before its run was recorded

    service = service_for(store, recorder, omni_engine).start()  # takes the dead worker's job over
    try:
        assert service.wait(job.id, 300)
        done = service.get(job.id)
    finally:
        service.close()
    assert done.status == "succeeded", done.error
    assert [i.attempts for i in done.items] == [1, 2, 1, 1]
    assert done.items[0].run_id == first  # the finished cell never ran again
    recorder.flush()
    listed = store.list_runs(RunFilter(source="job"), limit=100)
    cells = [r for r in (store.get_run(s.id) for s in listed) if r.request.get("job") == job.id]
    succeeded = sorted(
        r.request["item"] for r in cells if r.status == "succeeded" and not r.request.get("grid")
    )
    assert succeeded == [0, 1, 2, 3]  # one succeeded run per cell, none missing
    assert all(store.get_run(i.run_id).audio for i in done.items)
    assert len([r for r in cells if r.request.get("grid")]) == 1


# -- the Queue panel -----------------------------------------------------------------------------------


def test_the_queue_says_what_a_speech_job_and_a_spoken_request_make(store, recorder, omni_engine):
    board = RequestBoard()
    service = service_for(store, recorder, omni_engine, board=board)  # not started: the job stays queued
    view = QueueView(board, service)
    viewer = Viewer.of_ui("s-me", None, None)
    spec = parse_job_spec({"prompts": ["hi"], "seeds": [1], "x": {"param": "voice", "values": VOICES}})
    job = service.submit(spec, "ui", viewer.job_owner)
    (row,) = view.rows(viewer)
    assert row.id == job.id and row.output == "audio · voices Chelsie, Ethan"
    assert row.cells()[view_column("output")] == "audio · voices Chelsie, Ethan"

    runs = RunService(recorder, "api", store.files, board=board)
    seen: list[str] = []

    async def one_request() -> None:
        resolved = runs.resolve(omni_engine, cell_request(spec.parameters(spec.cells()[1])))
        tracker = runs.start(omni_engine, resolved, MODEL, None, {"prompt": "hi"})
        async for _event in runs.events(omni_engine, resolved, tracker, client="10.0.0.9|-"):
            seen.extend(r.cells()[view_column("output")] for r in view.rows(viewer) if r.kind == "request")

    asyncio.run(one_request())
    assert seen and set(seen) == {"text+audio · Ethan"}
    assert output_of((OutputModality.IMAGE,), {"width": 64, "height": 48}) == "image 64x48"
    assert output_of((OutputModality.AUDIO,), {"voice": "Chelsie", "speed": 1.5}) == "audio · Chelsie · 1.5x"


def view_column(name: str) -> int:
    from studio.runs.queue import COLUMNS

    return COLUMNS.index(name)
