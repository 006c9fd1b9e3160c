"""`omni-studio run` on a model that speaks (docs/speech.md "Runs, files and the CLI"): the file `--out`
names, in the format its extension picks, decoded; the text reply; a bar per stage; `--voice` and
`--modalities`; the run in the history; errors that name the flag and the allowed values."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile

from engine import OmniEngine, build_engine
from engine.tempo import SLACK
from studio.cli import main
from studio.media.audio import read_audio_recipe
from studio.store import open_store
from tests.conftest import tiny_deploy

RATE = 24000
LINE = re.compile(r"^(?P<path>\S+) \((?P<seconds>[\d.]+)s of audio, (?P<fmt>\w+)\)$", re.M)


class _EngineKeptOpen:
    """The module's engine as `cmd_run` sees it: `run` closes its engine at the end; this one lives on."""

    def __init__(self, engine: OmniEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def omni(session_data_dir: Path) -> Iterator[OmniEngine]:
    engine = build_engine("tiny-qwen-omni", tiny_deploy("tiny-qwen-omni"), data_dir=session_data_dir)
    yield engine
    engine.close()


@pytest.fixture
def run(omni, monkeypatch, capsys, tmp_path):
    """`omni-studio run ARGS --data-dir D` in this process, on the module's engine: (exit code, stdout, stderr)."""
    monkeypatch.setattr("studio.startup.launch.start_engine", lambda settings: _EngineKeptOpen(omni))
    data = tmp_path / "data"

    def call(*args: str) -> tuple[int, str, str]:
        code = main(["run", *args, "--model", "tiny-qwen-omni", "--data-dir", str(data)])
        out, err = capsys.readouterr()
        return code, out, err

    call.data_dir = data  # type: ignore[attr-defined]
    return call


def recorded_runs(data_dir: Path) -> list:
    with open_store(None, data_dir) as store:
        return [store.get_run(summary.id) for summary in reversed(store.list_runs())]  # oldest first


def test_run_speaks_into_a_wav_and_records_the_run(run, tmp_path: Path) -> None:
    out = tmp_path / "hi.wav"
    code, stdout, stderr = run("say hello", "--out", str(out), "--voice", "Ethan", "--seed", "3")
    assert code == 0, stderr
    # One bar per stage, named by the hand-offs, counting tokens, codes and steps.
    for label, unit in (("stage 0 thinker", "tok"), ("stage 1 talker", "code"), ("stage 2 code2wav", "step")):
        assert re.search(rf"{label}: .*{unit}/s", stderr), (label, stderr)
    # The file: 16-bit WAV at 24 kHz, audible, as long as the line says.
    samples, rate = soundfile.read(out, dtype="float32")
    assert rate == RATE and soundfile.info(out).subtype == "PCM_16"
    assert samples.size > 0 and np.abs(samples).max() > 0.01
    [line] = LINE.finditer(stdout)
    assert line["path"] == str(out) and line["fmt"] == "wav"
    assert float(line["seconds"]) == pytest.approx(samples.size / RATE, abs=0.005)
    # The recorded run: the file the user got is the one the store keeps (same sha256), with its figures.
    [recorded] = recorded_runs(run.data_dir)
    assert (recorded.source, recorded.status, recorded.seed) == ("cli", "succeeded", 3)
    assert recorded.parameters["voice"] == "Ethan" and recorded.request["voice"] == "Ethan"
    [audio] = recorded.audio
    assert audio.sha256 == hashlib.sha256(out.read_bytes()).hexdigest() and audio.mime == "audio/wav"
    assert audio.duration_seconds == pytest.approx(samples.size / RATE)
    assert recorded.ttfp_seconds is not None and recorded.realtime_factor is not None
    assert 0 < recorded.ttfp_seconds <= recorded.realtime_factor * recorded.audio_seconds + 1e-9
    assert f"recorded as run {recorded.id[:12]}" in stderr
    # The text reply is printed (streamed, then its line ends), and it is the run's text.
    assert recorded.text and stdout.splitlines()[0] == recorded.text
    recipe = read_audio_recipe(out.read_bytes())
    assert recipe is not None and recipe["parameters"]["voice"] == "Ethan"


@pytest.mark.parametrize(
    ("name", "container"), [("hi.flac", "FLAC"), ("hi.mp3", "MP3"), ("hi.ogg", "OGG"), ("HI.WAV", "WAV")]
)
def test_the_extension_picks_the_format(run, tmp_path: Path, name: str, container: str) -> None:
    reference = tmp_path / "reference.wav"
    assert run("say hello", "--out", str(reference), "--seed", "4", "--quiet")[0] == 0
    out = tmp_path / name
    code, stdout, stderr = run("say hello", "--out", str(out), "--seed", "4", "--quiet")
    assert code == 0, stderr
    info = soundfile.info(out)
    assert info.format == container and info.samplerate == RATE and info.channels == 1
    expected, _ = soundfile.read(reference, dtype="float32")
    decoded, _ = soundfile.read(out, dtype="float32")
    if container in ("WAV", "FLAC"):  # lossless: the very same samples
        assert np.array_equal(decoded, expected)
        assert read_audio_recipe(out.read_bytes()) is not None
    else:  # lossy: the same length within the codec's padding, and audible
        assert abs(decoded.size - expected.size) / RATE < 0.1 and np.abs(decoded).max() > 0.01
    assert f"({expected.size / RATE:.2f}s of audio" in stdout
    # The store keeps WAV whatever --out asked for: both runs made the same samples, so the same file.
    first, second = recorded_runs(run.data_dir)
    assert second.audio[0].mime == "audio/wav" and second.audio[0].sha256 == first.audio[0].sha256


def test_modalities_choose_what_the_run_makes(run, tmp_path: Path) -> None:
    code, stdout, stderr = run("say hello", "--modalities", "text", "--seed", "2")
    assert code == 0, stderr
    assert "stage 0 thinker" in stderr and "stage 1" not in stderr and "stage 2" not in stderr
    out = tmp_path / "only-audio.wav"
    code, stdout_audio, stderr = run("say hello", "--modalities", "audio", "--out", str(out), "--seed", "2")
    assert code == 0, stderr
    assert soundfile.info(out).frames > 0
    text_run, audio_run = recorded_runs(run.data_dir)
    assert text_run.text and stdout.strip() == text_run.text
    assert text_run.audio == [] and [s.stage_id for s in text_run.stages] == [0]
    assert text_run.audio_seconds is None and text_run.parameters["modalities"] == ["text"]
    assert audio_run.parameters["modalities"] == ["audio"] and audio_run.text is None
    assert [o.kind for o in audio_run.outputs] == ["audio"]
    assert stdout_audio.splitlines()[0].startswith(str(out))  # no text reply to print


def test_speed_makes_a_shorter_file_and_is_recorded(run, tmp_path: Path) -> None:
    spoken, fast = tmp_path / "spoken.wav", tmp_path / "fast.wav"
    assert run("say hello", "--out", str(spoken), "--seed", "3")[0] == 0
    code, stdout, stderr = run("say hello", "--out", str(fast), "--seed", "3", "--speed", "1.5")
    assert code == 0, stderr
    assert soundfile.info(fast).frames == round(soundfile.info(spoken).frames / 1.5) + SLACK
    assert read_audio_recipe(fast.read_bytes())["parameters"]["speed"] == 1.5
    assert recorded_runs(run.data_dir)[-1].parameters["speed"] == 1.5


def test_a_spoken_files_recipe_runs_again_and_finds_its_run(run, tmp_path: Path, capsys) -> None:
    """`run --recipe X.wav` says the same words in the same voice at the same tempo (the same samples);
    `history show --file` finds the run a WAV (by its bytes) or a FLAC (by its recipe) came from."""
    first, flac = tmp_path / "first.wav", tmp_path / "first.flac"
    args = (
        "be brief",
        "--speak-text",
        "these exact words",
        "--voice",
        "Ethan",
        "--speed",
        "1.25",
        "--seed",
        "8",
    )
    assert run(*args, "--out", str(first))[0] == 0
    assert run(*args, "--out", str(flac))[0] == 0
    again = tmp_path / "again.wav"
    code, _, stderr = run("--recipe", str(first), "--out", str(again))
    assert code == 0, stderr
    assert "the same samples as the recipe's audio" in stderr and "differs from the recipe" not in stderr
    assert np.array_equal(soundfile.read(again, dtype="int16")[0], soundfile.read(first, dtype="int16")[0])
    runs = recorded_runs(run.data_dir)
    assert runs[-1].parameters["speak_text"] == "these exact words" and runs[-1].parameters["speed"] == 1.25
    assert runs[-1].parameters["voice"] == "Ethan" and runs[-1].parameters["modalities"] == ["text", "audio"]
    for path, how in ((first, "the file is an output of"), (flac, "its recipe matches")):
        code = main(["history", "show", "--file", str(path), "--data-dir", str(run.data_dir)])
        out = capsys.readouterr().out
        assert code == 0 and how in out and runs[0].id[:12] in out, out
    (tmp_path / "plain.wav").write_bytes(b"RIFF....WAVEfmt ")
    assert (
        main(["history", "show", "--file", str(tmp_path / "plain.wav"), "--data-dir", str(run.data_dir)]) == 2
    )
    assert "no run recorded for this file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--out", "hi.txt"],
            "--out 'hi.txt': the file's extension picks the audio format; use one of .wav, .flac, .mp3, .ogg",
        ),
        ([], "--out FILE is required: tiny-qwen-omni speaks"),
        (
            ["--out", "hi.wav", "--voice", "Bob"],
            "voice: tiny-qwen-omni has no voice 'Bob'; allowed: Chelsie, Ethan",
        ),
        (
            ["--modalities", "text+video"],
            "--modalities: unknown output modality 'video' in 'text+video'; valid names",
        ),
        (
            ["--modalities", "latent"],
            "--modalities: latent is not an output a run can ask for; use text, image, audio",
        ),
        (
            ["--modalities", "image", "--out", "x.png"],
            "modalities: tiny-qwen-omni produces text+audio; cannot produce image",
        ),
        (
            ["--out", "hi.wav", "--speed", "9"],
            "speed: must be a number from 0.25 to 4 (1.0: as spoken), got 9.0",
        ),
        (
            ["--modalities", "text", "--out", "hi.wav"],
            "--out hi.wav: an audio file, but this run makes no audio (text)",
        ),
    ],
)
def test_bad_flags_are_clear_errors(run, tmp_path: Path, monkeypatch, args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run("say hello", *args)
    assert code == 2 and message in stderr, stderr
    assert not list(tmp_path.glob("hi.*")) and not list(tmp_path.glob("x.*"))  # nothing written
    assert not (run.data_dir / "runs.db").exists() or recorded_runs(run.data_dir) == []  # nothing ran


def test_the_command_as_typed(tmp_path: Path) -> None:
    """The real `omni-studio` process: the model named on the command line, built-in and loaded from scratch."""
    out = tmp_path / "hi.wav"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "studio.cli",
            "run",
            "say hello",
            "--model",
            "tiny-qwen-omni",
            "--out",
            str(out),
            "--voice",
            "Ethan",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "stage 2 code2wav" in done.stderr and f"{out} (" in done.stdout
    samples, rate = soundfile.read(out)
    assert rate == RATE and samples.size > 0 and np.abs(samples).max() > 0.01


def test_several_variants_write_one_file_each(run, tmp_path: Path) -> None:
    out = tmp_path / "hi.flac"
    code, stdout, stderr = run("say hello", "--out", str(out), "--n", "2", "--seed", "3", "--quiet")
    assert code == 0, stderr
    first, second = tmp_path / "hi-0.flac", tmp_path / "hi-1.flac"
    assert [m["path"] for m in LINE.finditer(stdout)] == [str(first), str(second)] and not out.exists()
    a, rate_a = soundfile.read(first)
    b, rate_b = soundfile.read(second)
    assert rate_a == rate_b == RATE and a.size and b.size
    assert a.size != b.size or not np.array_equal(a, b)  # seeds 3 and 4: two different utterances
    [recorded] = recorded_runs(run.data_dir)
    assert [o.index for o in recorded.audio] == [0, 1]
    assert recorded.audio_seconds == pytest.approx((a.size + b.size) / RATE)
