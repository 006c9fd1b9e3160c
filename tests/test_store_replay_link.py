"""Replays link to their originals in the run store (``runs.replay_of``, docs/replay.md): recorded by the
recorder (runs that ran and refused ones), filtered, shown, and carried by bundles; on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.register_assert_rewrite("conftest_store")  # a plugin of these tests and a module of helpers

from conftest_store import new_database_url, resolved_request, success_events  # noqa: E402

from engine.config import PipelineConfig  # noqa: E402
from studio.store import (  # noqa: E402
    RunFilter,
    RunRecorder,
    RunStore,
    export_bundle,
    import_bundle,
    open_store,
)
from studio.store.terminal import format_run_detail  # noqa: E402

pytest_plugins = ["conftest_store"]


def test_replays_are_linked_filtered_shown_and_exported(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig, request, tmp_path: Path
) -> None:
    original = store.create_run(source="api", prompt="a red fox", model="m", request={}, parameters={})
    store.finish_run(original, "succeeded")
    other = store.create_run(source="ui", prompt="a blue fox", model="m", request={}, parameters={})
    store.finish_run(other, "succeeded")

    resolved = resolved_request("a red fox")
    tracker = recorder.start_run("cli", resolved, pipeline_config, "m", None, {}, replay_of=original)
    for event in success_events(resolved):
        tracker.observe(event)
    refused = recorder.record_rejected(
        "ui",
        {"prompt": "a red fox"},
        "replay refused: n: too many",
        "m",
        pipeline_config,
        None,
        replay_of=original,
    )
    recorder.flush()

    assert store.get_run(tracker.run_id).replay_of == original
    assert store.get_run(refused).status == "failed" and store.get_run(refused).replay_of == original
    assert store.get_run(original).replay_of is None
    replays = store.list_runs(RunFilter(replay_of=original))
    assert {r.id for r in replays} == {tracker.run_id, refused}
    assert all(r.replay_of == original for r in replays)
    assert {r.id for r in store.list_runs(RunFilter(replays=False))} == {original, other}
    assert store.count_runs(RunFilter(replays=True, status="succeeded")) == 1
    assert re.search(rf"^  replay of +{original}$", format_run_detail(store.get_run(tracker.run_id)), re.M)

    bundle = tmp_path / "runs.zip"
    assert export_bundle(store, bundle) == 4
    backend = "sqlite" if store.dialect == "sqlite" else "postgres"
    with open_store(new_database_url(backend, tmp_path, request), tmp_path / "other-data") as target:
        assert import_bundle(target, bundle).imported == 4
        assert {r.id for r in target.list_runs(RunFilter(replay_of=original))} == {tracker.run_id, refused}
