"""`omni-studio history ls|show|export|import`, and `omni-studio run` recording its run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("conftest_store")  # a plugin of these tests and a module of helpers

from conftest_store import failure_events, new_database_url, record, resolved_request, success_events  # noqa: E402

from engine.config import PipelineConfig  # noqa: E402
from studio.cli import main  # noqa: E402
from studio.store import RunRecorder, open_store  # noqa: E402

pytest_plugins = ["conftest_store"]


@pytest.fixture
def history(db_url: str, data_dir: Path, pipeline_config: PipelineConfig) -> dict[str, str]:
    """A store with three runs: a fox (succeeded, newest), a failed owl, and a cat (succeeded, oldest)."""
    ids = {}
    with open_store(db_url, data_dir) as store:
        recorder = RunRecorder(store)
        for name, prompt in (("cat", "a sleepy cat"), ("owl", "an owl at night"), ("fox", "A red FOX")):
            resolved = resolved_request(prompt)
            events = (
                failure_events(resolved, "stage 1 (diffusion) failed: boom")
                if name == "owl"
                else success_events(resolved)
            )
            ids[name] = record(recorder, pipeline_config, events, resolved)
            recorder.flush()
        recorder.close()
    return ids


def cli(capsys: pytest.CaptureFixture, db_url: str, data_dir: Path, *args: str) -> tuple[int, str, str]:
    code = main(["history", *args, "--db", db_url, "--data-dir", str(data_dir)])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_table(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, _ = cli(capsys, db_url, data_dir, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "CREATED", "SOURCE", "STATUS", "MODEL", "TIME", "IMAGES", "PROMPT"]
    assert [line.split()[0] for line in lines[1:4]] == [history[k][:12] for k in ("fox", "owl", "cat")]
    assert "succeeded" in lines[1] and "A red FOX" in lines[1] and "failed" in lines[2]
    assert lines[-1] == "3 of 3 runs"


def test_ls_filters_and_json(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--json", "--search", "fox")
    assert code == 0
    [run] = json.loads(out)
    assert (run["id"], run["prompt"], run["status"], run["image_count"]) == (
        history["fox"],
        "A red FOX",
        "succeeded",
        1,
    )
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--json", "--status", "failed")
    assert [r["id"] for r in json.loads(out)] == [history["owl"]]
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--limit", "1")
    assert (
        history["fox"][:12] in out
        and history["cat"][:12] not in out
        and out.splitlines()[-1] == "1 of 3 runs"
    )


def test_ls_rejects_an_unknown_status(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, _, err = cli(capsys, db_url, data_dir, "ls", "--status", "done")
    assert code == 2 and "unknown status 'done'" in err and "succeeded" in err


def test_ls_on_an_empty_store(db_url: str, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = cli(capsys, db_url, data_dir, "ls")
    assert (code, out.strip()) == (0, "no runs recorded yet")


def test_show_by_prefix(
    history: dict[str, str],
    db_url: str,
    data_dir: Path,
    capsys: pytest.CaptureFixture,
    pipeline_config: PipelineConfig,
) -> None:
    code, out, _ = cli(capsys, db_url, data_dir, "show", history["owl"][:8])
    assert code == 0
    assert out.startswith(f"run {history['owl']}\n")
    assert "failed" in out and "stage 1 (diffusion) failed: boom" in out and "an owl at night" in out
    assert pipeline_config.config_hash()[:8] in out
    assert "stages" in out and "diffusion" in out

    code, out, _ = cli(capsys, db_url, data_dir, "show", history["fox"], "--json")
    detail = json.loads(out)
    assert detail["id"] == history["fox"] and detail["config"] == pipeline_config.to_dict()
    [image] = detail["outputs"]
    assert Path(image["path"]).is_file() and image["sha256"] in image["path"]


def test_show_unknown_or_ambiguous_ids(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, _, err = cli(capsys, db_url, data_dir, "show", "zzzz")
    assert code == 2 and "no run id starts with 'zzzz'" in err
    code, _, err = cli(capsys, db_url, data_dir, "show", "")
    assert code == 2


def test_export_then_import_elsewhere(
    history: dict[str, str],
    db_url: str,
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    bundle = tmp_path / "runs.zip"
    code, out, _ = cli(capsys, db_url, data_dir, "export", str(bundle))
    assert (code, out.strip()) == (0, f"exported 3 runs to {bundle}")

    backend = "sqlite" if db_url.startswith("sqlite") else "postgres"
    other_url, other_dir = new_database_url(backend, tmp_path, request), tmp_path / "other"
    code, out, _ = cli(capsys, other_url, other_dir, "import", str(bundle))
    assert (code, out.strip()) == (0, "imported 3 runs, skipped 0 already present")
    code, out, _ = cli(capsys, other_url, other_dir, "import", str(bundle))
    assert (code, out.strip()) == (0, "imported 0 runs, skipped 3 already present")
    code, out, _ = cli(capsys, other_url, other_dir, "ls", "--json")
    assert sorted(r["id"] for r in json.loads(out)) == sorted(history.values())

    code, _, err = cli(capsys, other_url, other_dir, "import", str(tmp_path / "missing.zip"))
    assert code == 2 and "not a history bundle" in err


def test_a_bad_database_url_is_a_clear_error(data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli(capsys, "nosuchdb://x", data_dir, "ls")
    assert code == 2 and "nosuchdb://x" in err


class _EngineKeptOpen:
    """The shared test engine as `cmd_run` sees it: `run` closes its engine at the end; this one lives on."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


def test_omni_studio_run_is_recorded(
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tiny_engine,
) -> None:
    """The real `run` command (on the already loaded tiny engine) with no --db: SQLite in the data dir.

    Recording itself goes through the same RunRecorder the other tests run on both databases.
    """
    monkeypatch.setattr("studio.startup.launch.start_engine", lambda settings: _EngineKeptOpen(tiny_engine))
    out_file = tmp_path / "fox.png"
    code = main(
        [
            "run",
            "a red fox",
            "--out",
            str(out_file),
            "--seed",
            "5",
            "--steps",
            "1",
            "--height",
            "32",
            "--width",
            "32",
            "--quiet",
            "--data-dir",
            str(data_dir),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0 and out_file.exists()
    assert "recorded as run" in err

    with open_store(None, data_dir) as store:
        [summary] = store.list_runs()
        run = store.get_run(summary.id)
    assert (run.source, run.status, run.prompt, run.seed, run.fingerprint) == (
        "cli",
        "succeeded",
        "a red fox",
        5,
        None,
    )
    assert run.request["steps"] == 1 and run.model == "tiny-glm-image"
    assert run.config_hash == tiny_engine.config_hash
    assert len(run.stages) == 2 and all(s.status == "succeeded" for s in run.stages)
    [image] = run.images
    assert image.path.read_bytes() == out_file.read_bytes()  # the file the user got is the one recorded
    assert (data_dir / "runs.db").exists()


def test_prune_by_filter(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, _out, err = cli(capsys, db_url, data_dir, "prune")
    assert code == 2 and "give a filter" in err  # never everything by accident
    code, out, _ = cli(capsys, db_url, data_dir, "prune", "--status", "failed", "--dry-run")
    assert code == 0 and "would delete 1 run " in out
    code, out, _ = cli(capsys, db_url, data_dir, "prune", "--search", "owl", "--vacuum")
    assert code == 0 and out.startswith("deleted 1 run") and "vacuumed" in out
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--json")
    assert {r["id"] for r in json.loads(out)} == {history["fox"], history["cat"]}
    code, out, _ = cli(capsys, db_url, data_dir, "prune", "--older-than", "1")
    assert code == 0 and out.startswith("deleted 0 runs")


def test_ls_into_a_closed_pipe_stops_quietly(history: dict[str, str], db_url: str, data_dir: Path) -> None:
    """`omni-studio history ls | head -0`: the reader is gone before anything is written; no traceback."""
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "studio.cli",
        "history",
        "ls",
        "--db",
        db_url,
        "--data-dir",
        str(data_dir),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # like `head` exiting at once
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_ls_shows_a_spoken_runs_audio_ttfp_and_rtf_and_filters_by_output(
    history: dict[str, str], db_url: str, data_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """With a spoken run listed, `history ls` adds AUDIO, TTFP and RTF columns (docs/speech.md "Runs,
    files and the CLI"); `--output audio` keeps the runs that spoke."""
    with open_store(db_url, data_dir) as store:
        spoken = store.create_run(
            source="api", prompt="say good night", model="tiny-qwen-omni", request={}, parameters={}
        )
        store.add_output(
            spoken, 0, b"RIFF not really a wav", "audio/wav", duration_seconds=1.24, sample_rate=24000
        )
        store.finish_run(
            spoken,
            "succeeded",
            audio={"ttfp_seconds": 0.3126, "audio_seconds": 1.24, "realtime_factor": 0.4567},
        )
    code, out, _ = cli(capsys, db_url, data_dir, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "ID",
        "CREATED",
        "SOURCE",
        "STATUS",
        "MODEL",
        "TIME",
        "IMAGES",
        "AUDIO",
        "TTFP",
        "RTF",
        "PROMPT",
    ]
    row = lines[1].split()
    assert row[0] == spoken[:12] and row[-3:] == ["say", "good", "night"]
    assert row[-6:-3] == ["1.24s", "0.313s", "0.46"]
    fox = lines[2].split()
    assert fox[0] == history["fox"][:12] and fox[-6:-3] == ["-", "-", "-"]  # an image run: no figures

    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--output", "audio")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:-1]] == [spoken[:12]]
    assert out.splitlines()[-1] == "1 of 1 run"
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--output", "image", "--json")
    assert sorted(r["id"] for r in json.loads(out)) == sorted([history["fox"], history["cat"]])
    code, out, _ = cli(capsys, db_url, data_dir, "ls", "--output", "audio", "--json")
    [run] = json.loads(out)
    assert (run["audio_seconds"], run["ttfp_seconds"], run["realtime_factor"], run["audio_count"]) == (
        1.24,
        0.3126,
        0.4567,
        1,
    )
    code, _, err = cli(capsys, db_url, data_dir, "ls", "--output", "sound")
    assert code == 2 and "unknown output kind 'sound'" in err and "audio" in err
