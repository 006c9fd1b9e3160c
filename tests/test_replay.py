"""Replay with a regression report (docs/replay.md): `omni-studio replay` re-runs recorded tiny-glm-shapes
runs, records the replays linked to their originals, and reports identical bytes on the same config,
pixel differences and PSNR with fewer diffusion steps, and failures with their error; exit 0 / 1 / 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from studio import __version__
from studio.cli import main
from studio.replay.replayer import unserved_fingerprint
from studio.replay.report import compare_runs, pixel_difference
from studio.store import RunFilter, open_store
from tests.conftest import tiny_deploy

MODEL = "tiny-glm-shapes"
PROMPTS = (  # seed, prompt, steps (None: the deploy config's default, 8)
    (11, "a red circle on a blue background, top left", None),
    (12, "a yellow square on a purple background, center", None),
    (13, "a green triangle on a cyan background, bottom right", None),
    (14, "a blue square on a yellow background, top right", 6),
)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[Path, list[str]]:
    """A data dir with four tiny-glm-shapes runs at 64x64, three with the preset's 8 steps and one that
    asked for 6, recorded the way the API records them (source api, the default full fingerprint)."""
    from engine import GenerationParams, GenerationRequest, build_engine
    from studio.api.fingerprint import FingerprintSettings, system_fingerprint
    from studio.runs.service import RunService
    from studio.store.recorder import RunRecorder

    data_dir = tmp_path_factory.mktemp("replay-data")
    engine = build_engine(MODEL, None, data_dir=data_dir)
    recorder = RunRecorder(open_store(None, data_dir))
    ids = []
    try:
        runs = RunService(recorder, "api", recorder.store.files)
        fingerprint = system_fingerprint(FingerprintSettings(), engine.config)
        for seed, prompt, steps in PROMPTS:
            params = GenerationParams(seed=seed, height=64, width=64, num_inference_steps=steps)
            request = GenerationRequest(prompt, params)
            resolved = runs.resolve(engine, request)
            tracker = runs.start(engine, resolved, MODEL, fingerprint, {"prompt": prompt, "seed": seed})
            runs.run_blocking(engine, resolved, tracker)
            ids.append(tracker.run_id)
    finally:
        recorder.close()
        recorder.store.close()
        engine.close()
    return data_dir, ids


def replay(data_dir: Path, *args: str) -> int:
    return main(["replay", "--data-dir", str(data_dir), "--quiet", *args])


def replays_of(data_dir: Path, run_id: str) -> list:
    with open_store(None, data_dir) as store:
        return [store.get_run(r.id) for r in store.list_runs(RunFilter(replay_of=run_id, status=None))]


def test_replay_on_the_recorded_config_is_byte_identical(history, tmp_path):
    data_dir, ids = history
    report_path = tmp_path / "same.json"
    assert replay(data_dir, "--filter", f"model={MODEL}", "--report", str(report_path)) == 0
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"total": 4, "identical": 4, "changed": 0, "failed": 0}
    assert report["exit_code"] == 0
    assert sorted(entry["original_id"] for entry in report["runs"]) == sorted(ids)
    with open_store(None, data_dir) as store:
        for entry in report["runs"]:
            original, again = store.get_run(entry["original_id"]), store.get_run(entry["replay_id"])
            # linked, recorded like any CLI run, on the very config the original ran on (rebuilt from its snapshot)
            assert again.replay_of == original.id and again.source == "cli" and again.status == "succeeded"
            assert again.config_hash == original.config_hash == entry["config_hash_after"]
            assert again.fingerprint == original.fingerprint == entry["fingerprint_after"]
            assert again.parameters == original.parameters
            # identical stored bytes, and the report says so with the numbers of identical pixels
            assert [o.sha256 for o in again.images] == [o.sha256 for o in original.images]
            (output,) = entry["outputs"]
            assert output["bytes_identical"] and output["identical"]
            assert (output["max_abs_diff"], output["mean_abs_diff"], output["psnr_db"]) == (0, 0.0, "inf")
            assert output["before_size"] == output["after_size"] == "64x64"
    for run_id in ids:
        assert len(replays_of(data_dir, run_id)) == 1


def test_fewer_steps_changes_every_run_and_the_report_has_the_numbers(history, tmp_path):
    data_dir, ids = history
    deploy = tiny_deploy(MODEL)
    stage1 = next(s for s in deploy["stages"] if s["stage_id"] == 1)
    assert stage1["default_sampling_params"]["num_inference_steps"] == 8  # what the originals ran with
    stage1["default_sampling_params"]["num_inference_steps"] = 4
    fewer = tmp_path / "fewer-steps.yaml"
    fewer.write_text(yaml.safe_dump(deploy))

    defaults = ids[:3]  # the runs that took their 8 steps from the config; ids[3] asked for 6

    # The exact recorded parameters keep 8 steps: nothing changes, and the report says why.
    kept = tmp_path / "kept.md"
    assert replay(data_dir, "--ids", *defaults, "--deploy-config", str(fewer), "--report", str(kept)) == 0
    text = kept.read_text()
    assert "**Summary: 3 runs: 3 identical, 0 changed, 0 failed.**" in text
    assert text.count("num_inference_steps kept at 8 as recorded; the target config's default is 4") == 3

    # The config's defaults: 4 steps, every run changed, with finite PSNR and a nonzero max difference.
    report_path = tmp_path / "fewer.json"
    args = ("--deploy-config", str(fewer), "--params", "config", "--report", str(report_path))
    assert replay(data_dir, "--ids", *defaults, *args) == 1
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"total": 3, "identical": 0, "changed": 3, "failed": 0}
    with open_store(None, data_dir) as store:
        for entry in report["runs"]:
            assert entry["verdict"] == "changed"
            assert entry["config_hash_before"] != entry["config_hash_after"]
            # the fingerprint the original was served with, as the same settings give it on the new config
            assert entry["fingerprint_before"].endswith(entry["config_hash_before"][:8])
            assert entry["fingerprint_after"] == f"omni-studio-{__version__}-{entry['config_hash_after'][:8]}"
            assert entry["notes"] == ["num_inference_steps: 8 -> 4 (the target config's default)"]
            again = store.get_run(entry["replay_id"])
            assert again.replay_of == entry["original_id"]
            assert again.parameters["num_inference_steps"] == 4 and again.parameters["height"] == 64
            (output,) = entry["outputs"]
            assert not output["bytes_identical"] and output["before_size"] == output["after_size"]
            assert output["max_abs_diff"] > 0 and output["mean_abs_diff"] > 0
            assert isinstance(output["psnr_db"], float) and math.isfinite(output["psnr_db"])
            # the numbers are those of the two stored PNGs, decoded
            before = np.asarray(Image.open(output["before_path"]).convert("RGBA"), dtype=np.float64)
            after = np.asarray(Image.open(output["after_path"]).convert("RGBA"), dtype=np.float64)
            assert output["max_abs_diff"] == np.abs(before - after).max()
            mse = np.mean((before - after) ** 2)
            assert output["psnr_db"] == pytest.approx(10 * math.log10(255**2 / mse))


def test_a_replay_that_cannot_run_is_recorded_as_failed(history, tmp_path):
    data_dir, ids = history
    report_path = tmp_path / "chat.md"
    # tiny-chat writes text only: the recorded image request is refused, recorded and counted
    code = replay(
        data_dir, "--ids", ids[0][:10], ids[1], "--model", "tiny-chat", "--report", str(report_path)
    )
    assert code == 2
    text = report_path.read_text()
    assert "**Summary: 2 runs: 0 identical, 0 changed, 2 failed.**" in text
    assert "replay refused: modalities: tiny-chat produces text; cannot produce image" in text
    for run_id in ids[:2]:
        failed = [r for r in replays_of(data_dir, run_id) if r.model == "tiny-chat"]
        assert len(failed) == 1
        assert failed[0].status == "failed" and "cannot produce image" in (failed[0].error or "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--filter", "colour=red"),
            "--filter 'colour=red': expected KEY=VALUE with KEY one of search, status",
        ),
        (("--filter", "status=running"), "runs still in progress cannot be replayed"),
        (("--filter", "status=done"), "unknown status 'done'"),
        (("--ids", "ffffffffff"), "no run id starts with 'ffffffffff'"),
        (("--report", "report.txt"), "--report report.txt: the extension picks the format; use .md or .json"),
        (("--filter", "search=nothing like this"), "no runs to replay: 0 runs matching"),
    ],
)
def test_bad_selections_are_usage_errors(history, capsys, args, message):
    data_dir, _ids = history
    assert replay(data_dir, *args) == 2
    assert message in capsys.readouterr().err


def test_text_outputs_are_compared_with_a_unified_diff(tmp_path):
    """Chat replays compare their stored text: equal text is identical, other text shows as a diff."""
    with open_store(None, tmp_path) as store:

        def run(text: str) -> str:
            run_id = store.create_run(
                source="api", prompt="say hi", model="tiny-chat", request={}, parameters={}
            )
            store.add_output(run_id, 0, text.encode(), "text/plain; charset=utf-8")
            store.finish_run(run_id, "succeeded", text=text)
            return run_id

        original = store.get_run(run("hello there\nhow are you"))
        same = compare_runs(original, store.get_run(run("hello there\nhow are you")))
        changed = compare_runs(original, store.get_run(run("hello there\nwho are you")))
    assert same.verdict == "identical" and same.outputs[0].bytes_identical
    assert changed.verdict == "changed"
    assert changed.outputs[0].diff.splitlines()[-2:] == ["-how are you", "+who are you"]


def test_pixel_difference_of_images_of_two_sizes_says_so(tmp_path):
    small, large = tmp_path / "small.png", tmp_path / "large.png"
    Image.new("RGB", (64, 64), (10, 20, 30)).save(small)
    Image.new("RGB", (128, 64), (10, 20, 30)).save(large)
    difference = pixel_difference(small, large)
    assert not difference.same_size and difference.psnr_db is None and difference.max_abs is None
    assert (difference.before_size, difference.after_size) == ((64, 64), (128, 64))


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [
        (None, None),  # a CLI run, or --fingerprint-mode none
        ("my-build-7", "my-build-7"),  # --fingerprint-mode custom
        ("omni-studio-0.0.9-7c3a1b57", "omni-studio-{version}-{hash8}"),  # full/hash: computed again
    ],
)
def test_cli_replays_record_the_fingerprint_the_originals_settings_give(recorded, expected):
    """Nothing is served by `omni-studio replay`; a replay records what the original's fingerprint settings
    would give on the replay's config (on the same config: the original's own, so the PNG bytes match)."""
    from types import SimpleNamespace

    from engine.building import build_pipeline_config
    from engine.models import describe_model

    config = build_pipeline_config(describe_model(MODEL), tiny_deploy(MODEL, stage1={"max_num_seqs": 2}))
    original = SimpleNamespace(fingerprint=recorded, config_hash="7c3a1b57" + "0" * 56)
    want = expected and expected.format(version=__version__, hash8=config.hash8)
    assert unserved_fingerprint(original, config) == want  # type: ignore[arg-type]


def test_a_run_that_asked_for_its_steps_keeps_them_on_a_config_with_other_defaults(history, tmp_path):
    data_dir, ids = history
    deploy = tiny_deploy(MODEL)
    next(s for s in deploy["stages"] if s["stage_id"] == 1)["default_sampling_params"][
        "num_inference_steps"
    ] = 4
    fewer = tmp_path / "fewer-steps.yaml"
    fewer.write_text(yaml.safe_dump(deploy))
    report_path = tmp_path / "asked.json"
    args = ("--deploy-config", str(fewer), "--params", "config", "--report", str(report_path))
    assert replay(data_dir, "--ids", ids[3], *args) == 0
    (entry,) = json.loads(report_path.read_text())["runs"]
    assert entry["verdict"] == "identical" and entry["config_hash_before"] != entry["config_hash_after"]
    (output,) = entry["outputs"]
    assert output["identical"] and output["max_abs_diff"] == 0 and output["psnr_db"] == "inf"
    with open_store(None, data_dir) as store:
        assert store.get_run(entry["replay_id"]).parameters["num_inference_steps"] == 6


# -- spoken runs (tiny-qwen-omni) --------------------------------------------------------------------

SPEECH_MODEL = "tiny-qwen-omni"


@pytest.fixture(scope="module")
def spoken_history(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two spoken tiny-qwen-omni runs recorded as the API records them: a `/v1/audio/speech`-like one
    (given text to say, audio only, Ethan at 1.5x) and a chat reply spoken by Chelsie (text and audio)."""
    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.modality import OutputModality
    from studio.runs.service import RunService
    from studio.store.recorder import RunRecorder

    data_dir = tmp_path_factory.mktemp("replay-speech")
    engine = build_engine(SPEECH_MODEL, None, data_dir=data_dir)
    recorder = RunRecorder(open_store(None, data_dir))
    requests = [
        GenerationRequest(
            "",
            GenerationParams(seed=21, voice="Ethan", speed=1.5),
            modalities=(OutputModality.AUDIO,),
            speak_text="good night, sleep well",
        ),
        GenerationRequest("say hello", GenerationParams(seed=5, voice="Chelsie")),
    ]
    ids = []
    try:
        runs = RunService(recorder, "api", recorder.store.files)
        for request in requests:
            resolved = runs.resolve(engine, request)
            tracker = runs.start(engine, resolved, SPEECH_MODEL, None, {"prompt": request.prompt})
            runs.run_blocking(engine, resolved, tracker)
            ids.append(tracker.run_id)
    finally:
        recorder.close()
        recorder.store.close()
        engine.close()
    with open_store(None, data_dir) as store:
        spoken = [store.get_run(run_id) for run_id in ids]
    assert all(run.status == "succeeded" and run.audio for run in spoken)
    assert spoken[0].parameters["speak_text"] == "good night, sleep well"
    assert (spoken[0].parameters["voice"], spoken[0].parameters["speed"]) == ("Ethan", 1.5)
    assert spoken[0].parameters["modalities"] == ["audio"] and not spoken[0].text
    return data_dir, ids


def decoded(path: str) -> np.ndarray:
    import soundfile

    samples, rate = soundfile.read(path, dtype="float64")
    assert rate == 24000
    return samples


def test_a_spoken_run_replays_with_its_voice_speed_and_words_and_reports_identical_audio(
    spoken_history, tmp_path
):
    data_dir, ids = spoken_history
    report_path = tmp_path / "speech.json"
    assert replay(data_dir, "--ids", *ids, "--report", str(report_path)) == 0
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"total": 2, "identical": 2, "changed": 0, "failed": 0}
    with open_store(None, data_dir) as store:
        for entry in report["runs"]:
            original, again = store.get_run(entry["original_id"]), store.get_run(entry["replay_id"])
            # The same request again: voice, speed, the words to say and the modalities included.
            assert again.parameters == original.parameters
            assert again.text == original.text
            (audio,) = [o for o in entry["outputs"] if o["kind"] == "audio"]
            (stored,) = original.audio
            assert audio["identical"] and audio["max_sample_diff"] == 0 and audio["snr_db"] == "inf"
            assert audio["before_seconds"] == audio["after_seconds"] == pytest.approx(stored.duration_seconds)
            assert np.array_equal(decoded(audio["before_path"]), decoded(audio["after_path"]))
    markdown = tmp_path / "speech.md"
    assert replay(data_dir, "--ids", ids[0], "--report", str(markdown)) == 0
    text = markdown.read_text()
    assert "| audio (length · max sample diff · SNR) |" in text
    assert "max sample difference 0 · SNR inf dB" in text


def test_fewer_ode_steps_change_the_audio_and_the_report_has_its_figures(spoken_history, tmp_path):
    data_dir, ids = spoken_history
    deploy = tiny_deploy(SPEECH_MODEL)
    code2wav = next(s for s in deploy["stages"] if s["stage_id"] == 2)
    assert code2wav["default_sampling_params"]["num_inference_steps"] == 10  # what the originals ran with
    code2wav["default_sampling_params"]["num_inference_steps"] = 4
    fewer = tmp_path / "fewer-steps.yaml"
    fewer.write_text(yaml.safe_dump(deploy))
    report_path = tmp_path / "fewer.json"
    args = ("--deploy-config", str(fewer), "--params", "config", "--report", str(report_path))
    assert replay(data_dir, "--ids", ids[0], *args) == 1
    (entry,) = json.loads(report_path.read_text())["runs"]
    assert entry["verdict"] == "changed"
    assert entry["notes"] == ["num_inference_steps: 10 -> 4 (the target config's default)"]
    with open_store(None, data_dir) as store:
        original, again = store.get_run(entry["original_id"]), store.get_run(entry["replay_id"])
    assert again.parameters == {**original.parameters, "num_inference_steps": 4}
    (audio,) = entry["outputs"]
    assert audio["kind"] == "audio" and not audio["identical"] and not audio["bytes_identical"]
    # The figures are those of the two stored WAVs, decoded: the same codes (same length), other samples.
    before, after = decoded(audio["before_path"]), decoded(audio["after_path"])
    assert before.size == after.size and audio["before_seconds"] == audio["after_seconds"]
    assert (
        audio["max_sample_diff"] == pytest.approx(np.abs(after - before).max())
        and audio["max_sample_diff"] > 0
    )
    snr = 10 * math.log10(np.sum(before**2) / np.sum((after - before) ** 2))
    assert audio["snr_db"] == pytest.approx(snr) and math.isfinite(audio["snr_db"])


def test_a_run_that_heard_audio_cannot_be_replayed(tmp_path):
    from engine.building import build_pipeline_config
    from engine.models import describe_model
    from studio.replay.replayer import ReplayInputError, request_for_replay

    config = build_pipeline_config(describe_model(SPEECH_MODEL), None)
    with open_store(None, tmp_path) as store:
        run_id = store.create_run(
            source="ui",
            prompt="what do you hear",
            model=SPEECH_MODEL,
            request={},
            parameters={"seed": 3, "voice": "Chelsie", "input_audio_clips": 1},
        )
        detail = store.get_run(run_id)
    with pytest.raises(ReplayInputError, match=r"heard 1 audio clip\(s\) \(input_audio\)"):
        request_for_replay(detail, config)
