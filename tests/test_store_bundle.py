"""History bundles: export/import round trips keep every run, file and snapshot; re-imports add nothing."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

pytest.register_assert_rewrite("conftest_store")  # a plugin of these tests and a module of helpers

from conftest_store import failure_events, new_database_url, record, resolved_request, success_events  # noqa: E402

from engine.config import PipelineConfig  # noqa: E402
from studio.store import (  # noqa: E402
    BundleError,
    RunFilter,
    RunRecorder,
    RunStore,
    export_bundle,
    import_bundle,
    open_store,
)

pytest_plugins = ["conftest_store"]


def snapshot(store: RunStore) -> dict[str, dict]:
    """Every run as the user sees it, minus machine-specific paths."""
    runs = {}
    for summary in store.list_runs(limit=1000):
        detail = store.get_run(summary.id).to_dict()
        for output in detail["outputs"]:
            output["content"] = Path(output.pop("path")).read_bytes()
        runs[summary.id] = detail
    return runs


@pytest.fixture
def filled(recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig) -> RunStore:
    for i in range(3):
        resolved = resolved_request(f"good {i}", seed=i, n=1 + i % 2)
        record(recorder, pipeline_config, success_events(resolved), resolved, source=("ui", "api", "cli")[i])
    failed = resolved_request("bad one")
    record(recorder, pipeline_config, failure_events(failed), failed)
    running = resolved_request("still going")
    tracker = recorder.start_run("api", running, pipeline_config, "m", None, {})
    tracker.observe(success_events(running)[0])
    recorder.flush()
    return store


@pytest.fixture
def target(request: pytest.FixtureRequest, db_url: str, tmp_path: Path) -> RunStore:
    """A second, empty store on the same backend, with its own data dir."""
    backend = "sqlite" if db_url.startswith("sqlite") else "postgres"
    store = open_store(new_database_url(backend, tmp_path, request), tmp_path / "other-data")
    yield store
    store.close()


def test_round_trip_preserves_runs_files_and_snapshots(
    filled: RunStore, target: RunStore, tmp_path: Path
) -> None:
    bundle = tmp_path / "history.zip"
    assert export_bundle(filled, bundle) == 5
    result = import_bundle(target, bundle)
    assert (result.imported, result.skipped) == (5, 0)

    before, after = snapshot(filled), snapshot(target)
    assert before.keys() == after.keys()
    for run_id, run in before.items():
        imported = after[run_id]
        if run["status"] == "running":  # it cannot continue in another database
            assert imported.pop("status") == "interrupted" and "exported" in imported.pop("error")
            run.pop("status"), run.pop("error")
        assert imported == run
    assert sum(len(r["outputs"]) for r in after.values()) == 4  # images of n=1, n=2 and n=1 runs
    assert all(r["config"] is not None for r in after.values())


def test_import_twice_adds_nothing(filled: RunStore, target: RunStore, tmp_path: Path) -> None:
    bundle = tmp_path / "history.zip"
    export_bundle(filled, bundle)
    import_bundle(target, bundle)
    files = sorted(p.name for p in (target.data_dir / "outputs").rglob("*.*"))
    result = import_bundle(target, bundle)
    assert (result.imported, result.skipped) == (0, 5)
    assert target.count_runs() == 5
    assert sorted(p.name for p in (target.data_dir / "outputs").rglob("*.*")) == files


def test_import_into_a_database_with_other_runs(
    filled: RunStore, target: RunStore, tmp_path: Path, pipeline_config: PipelineConfig
) -> None:
    recorder = RunRecorder(target)
    own = resolved_request("already here")
    record(recorder, pipeline_config, success_events(own), own)
    recorder.close()
    bundle = tmp_path / "history.zip"
    export_bundle(filled, bundle)
    assert import_bundle(target, bundle).imported == 5
    assert target.count_runs() == 6
    # The same config was already snapshotted here; the import reused it.
    assert {r.config_hash for r in target.list_runs()} == {pipeline_config.config_hash()}


def test_export_a_filtered_selection(filled: RunStore, target: RunStore, tmp_path: Path) -> None:
    bundle = tmp_path / "failed.zip"
    assert export_bundle(filled, bundle, RunFilter(status="failed")) == 1
    assert import_bundle(target, bundle).imported == 1
    [run] = target.list_runs()
    assert run.prompt == "bad one" and run.status == "failed"
    with zipfile.ZipFile(bundle) as zf:
        assert not [n for n in zf.namelist() if n.startswith("files/")]


def test_bad_bundles_are_rejected_without_importing(
    filled: RunStore, target: RunStore, tmp_path: Path
) -> None:
    not_zip = tmp_path / "notes.txt"
    not_zip.write_text("hello")
    with pytest.raises(BundleError, match="not a history bundle"):
        import_bundle(target, not_zip)

    bundle = tmp_path / "history.zip"
    export_bundle(filled, bundle)
    corrupt = tmp_path / "corrupt.zip"
    with zipfile.ZipFile(bundle) as src, zipfile.ZipFile(corrupt, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.startswith("files/"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.writestr(item, data)
    with pytest.raises(BundleError, match="does not match its sha256"):
        import_bundle(target, corrupt)
    assert target.count_runs() == 0

    newer = tmp_path / "newer.zip"
    with zipfile.ZipFile(newer, "w") as zf:
        zf.writestr("manifest.json", json.dumps({"format": "omni-studio-runs", "version": 99}))
        zf.writestr("runs.json", "[]")
        zf.writestr("configs.json", "{}")
    with pytest.raises(BundleError, match="newer"):
        import_bundle(target, newer)


@pytest.mark.postgres
def test_sqlite_history_moves_to_postgresql(
    tmp_path: Path, request: pytest.FixtureRequest, pipeline_config: PipelineConfig
) -> None:
    with open_store(None, tmp_path / "sqlite-data") as sqlite_store:
        recorder = RunRecorder(sqlite_store)
        for i in range(3):
            resolved = resolved_request(f"run {i}", n=1 + i % 2)
            record(recorder, pipeline_config, success_events(resolved), resolved)
        recorder.close()
        bundle = tmp_path / "history.zip"
        export_bundle(sqlite_store, bundle)
        with open_store(new_database_url("postgres", tmp_path, request), tmp_path / "pg-data") as pg:
            assert import_bundle(pg, bundle).imported == 3
            assert snapshot(pg) == snapshot(sqlite_store)
