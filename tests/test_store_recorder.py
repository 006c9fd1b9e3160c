"""RunRecorder: engine events -> recorded runs, off the caller's thread, nothing lost under concurrency."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

# conftest_store is a plugin of these tests and a module of helpers: have pytest rewrite its asserts
# before the helpers are imported.
pytest.register_assert_rewrite("conftest_store")

from conftest_store import (  # noqa: E402
    PG_ENV,
    failure_events,
    image,
    new_database_url,
    record,
    resolved_request,
    success_events,
)

from engine.config import PipelineConfig  # noqa: E402
from engine.events import StageStarted  # noqa: E402
from studio.media.images import png_bytes  # noqa: E402
from studio.store import RunFilter, RunRecorder, RunStore, open_store  # noqa: E402

pytest_plugins = ["conftest_store"]


def test_png_bytes_is_deterministic_and_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = image((1, 2, 3)), image((1, 2, 3))
    assert png_bytes(a) == png_bytes(b)
    assert png_bytes(a).startswith(b"\x89PNG")
    calls = []
    original = type(a).save
    monkeypatch.setattr(
        type(a), "save", lambda self, *args, **kw: calls.append(1) or original(self, *args, **kw)
    )
    fresh = image((4, 5, 6))
    assert png_bytes(fresh) is png_bytes(fresh)
    assert len(calls) == 1


def test_a_successful_run(recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig) -> None:
    resolved = resolved_request("a red fox", seed=11)
    events = success_events(resolved)
    tracker = recorder.start_run(
        "api",
        resolved,
        pipeline_config,
        "glm-served",
        "omni-studio-0.1.0-1234abcd",
        {"model": "glm-served", "messages": [{"role": "user", "content": "a red fox"}]},
    )
    assert tracker.run_id == resolved.request_id  # known at once, before anything is written
    recorder.flush()
    assert store.get_run(tracker.run_id).status == "queued"
    tracker.observe(events[0])
    recorder.flush()
    assert store.get_run(tracker.run_id).status == "running"
    for event in events[1:]:
        tracker.observe(event)
    assert tracker.finished()
    recorder.flush()

    run = store.get_run(tracker.run_id)
    assert (run.status, run.source, run.model, run.error) == ("succeeded", "api", "glm-served", None)
    assert run.fingerprint == "omni-studio-0.1.0-1234abcd"
    assert run.config_hash == pipeline_config.config_hash()
    assert run.config == pipeline_config.to_dict()
    assert run.seed == 11 and run.parameters == resolved.parameters and run.prompt == "a red fox"
    assert run.request["messages"][0]["content"] == "a red fox"
    assert [(s.stage_id, s.kind, s.status) for s in run.stages] == [
        (0, "ar", "succeeded"),
        (1, "diffusion", "succeeded"),
    ]
    assert run.stages[0].output_tokens == 16 and run.stages[1].seconds == pytest.approx(0.3, abs=1e-3)
    [output] = run.outputs
    expected = png_bytes(events[-1].images[0])
    assert output.path.read_bytes() == expected and output.sha256 == hashlib.sha256(expected).hexdigest()
    assert (output.width, output.height, output.mime) == (32, 32, "image/png")
    assert (run.input_tokens, run.output_tokens) == (5, 16)
    assert run.started_at <= run.finished_at


def test_several_variants(recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig) -> None:
    resolved = resolved_request(n=2)
    run_id = record(recorder, pipeline_config, success_events(resolved), resolved)
    recorder.flush()
    run = store.get_run(run_id)
    assert [(s.variant_index, s.stage_id) for s in run.stages] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [o.index for o in run.images] == [0, 1]
    assert run.images[0].sha256 != run.images[1].sha256
    assert run.output_tokens == 32


def test_text_outputs(recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig) -> None:
    from engine.events import RunFinished, RunOutput

    resolved = resolved_request("say hi")
    tracker = recorder.start_run("ui", resolved, pipeline_config, "tiny-chat", None, {"prompt": "say hi"})
    tracker.observe(RunFinished(resolved.request_id, 0, (RunOutput(0, 1, text="hi there", output_tokens=2),)))
    recorder.flush()
    run = store.get_run(tracker.run_id)
    assert (run.status, run.text, run.fingerprint) == ("succeeded", "hi there", None)
    [output] = run.outputs
    assert (output.kind, output.path.read_text()) == ("text", "hi there")


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_failed_or_cancelled_run(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig, cancelled: bool
) -> None:
    resolved = resolved_request()
    message = "the request was cancelled" if cancelled else "stage 1 (diffusion) failed: RuntimeError: boom"
    run_id = record(recorder, pipeline_config, failure_events(resolved, message, cancelled), resolved)
    recorder.flush()
    run = store.get_run(run_id)
    assert (run.status, run.error) == ("cancelled" if cancelled else "failed", message)
    assert [s.status for s in run.stages] == ["succeeded", "cancelled" if cancelled else "failed"]
    assert run.outputs == []


def test_client_disconnect_is_recorded_as_cancelled(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig
) -> None:
    resolved = resolved_request()
    events = success_events(resolved)
    tracker = recorder.start_run("api", resolved, pipeline_config, "m", None, {})
    tracker.observe(events[0])
    assert tracker.fail("client disconnected", cancelled=True)
    assert not tracker.fail("again")
    tracker.observe(events[-1])  # the engine's late result does not overwrite the outcome
    recorder.flush()
    run = store.get_run(tracker.run_id)
    assert (run.status, run.error, run.outputs) == ("cancelled", "client disconnected", [])


def test_source_image_is_stored_and_the_data_url_is_not(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig
) -> None:
    source = image((0, 128, 255), size=64)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(source) + b"\0" * 4096).decode()
    resolved = resolved_request(source_image=source)
    tracker = recorder.start_run(
        "api",
        resolved,
        pipeline_config,
        "m",
        None,
        {"messages": [{"content": [{"type": "image_url", "image_url": {"url": data_url}}]}]},
    )
    recorder.flush()
    run = store.get_run(tracker.run_id)
    stored_url = run.request["messages"][0]["content"][0]["image_url"]["url"]
    assert stored_url.startswith("data:image/png;base64,<") and len(stored_url) < 200
    [source_output] = run.outputs
    assert source_output.kind == "source" and source_output.path.read_bytes() == png_bytes(source)


def test_eight_threads_recording_at_once_lose_nothing(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig
) -> None:
    per_thread = 6
    ids: list[str] = []
    lock = threading.Lock()

    def client(worker: int) -> None:
        for i in range(per_thread):
            resolved = resolved_request(f"prompt {worker}-{i}", seed=worker * 100 + i)
            events = success_events(resolved, [image((worker, i, 7))])
            run_id = record(recorder, pipeline_config, events, resolved)
            with lock:
                ids.append(run_id)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert recorder.flush(timeout=60)
    assert store.count_runs(RunFilter(status="succeeded")) == 8 * per_thread == len(set(ids))
    for run_id in ids:
        run = store.get_run(run_id)
        assert len(run.stages) == 2 and len(run.images) == 1 and run.images[0].path.exists()
    assert len(list((store.data_dir / "outputs").rglob("*.png"))) == 8 * per_thread


def test_the_event_loop_never_waits_for_the_database(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database that does not answer (a gate the test holds shut) does not hold up the handler: it
    starts the run and feeds it every event while the first write is still waiting on the database."""
    original = store.create_run
    entered, gate, written = threading.Event(), threading.Event(), threading.Event()

    def stuck_create_run(**kwargs):
        entered.set()
        gate.wait(timeout=120)  # the timeout only stops a hang
        try:
            return original(**kwargs)
        finally:
            written.set()

    monkeypatch.setattr(store, "create_run", stuck_create_run)

    async def handler() -> None:
        resolved = resolved_request()
        tracker = recorder.start_run("api", resolved, pipeline_config, "m", None, {})
        for event in success_events(resolved):
            tracker.observe(event)
            await asyncio.sleep(0)

    try:
        asyncio.run(handler())
        assert entered.wait(timeout=60), "the writer never reached the database"
        assert not written.is_set(), "the handler returned only after the database answered"
        assert store.count_runs() == 0  # still being written
    finally:
        gate.set()
    assert recorder.flush(timeout=60)
    assert written.is_set() and store.count_runs(RunFilter(status="succeeded")) == 1


def test_writer_errors_are_logged_and_the_writer_keeps_going(
    store: RunStore, pipeline_config: PipelineConfig, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = RunRecorder(store)
    try:
        resolved = resolved_request()
        stray = recorder.start_run("api", resolved, pipeline_config, "m", None, {})
        recorder.flush()
        # The same run id again: the insert fails (primary key), which must be reported, not swallowed.
        with caplog.at_level(logging.ERROR, logger="studio.store.recorder"):
            recorder.start_run("api", resolved, pipeline_config, "m", None, {})
            recorder.flush()
        assert recorder.errors == 1 and f"create run {stray.run_id}" in recorder.last_error
        assert any(f"create run {stray.run_id} failed" in r.getMessage() for r in caplog.records)

        later = resolved_request("after the error")
        run_id = record(recorder, pipeline_config, success_events(later), later)
        recorder.flush()
        assert store.get_run(run_id).status == "succeeded"
    finally:
        recorder.close()


def test_a_lost_output_file_is_noted_on_the_run(
    store: RunStore, pipeline_config: PipelineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = RunRecorder(store)
    try:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(store, "write_file", disk_full)  # the output file cannot be written
        resolved = resolved_request()
        run_id = record(recorder, pipeline_config, success_events(resolved), resolved)
        recorder.flush()
        run = store.get_run(run_id)
        assert run.status == "succeeded" and "No space left on device" in run.error
        assert recorder.errors == 1
    finally:
        recorder.close()


def test_close_writes_everything_queued(store: RunStore, pipeline_config: PipelineConfig) -> None:
    recorder = RunRecorder(store)
    resolved = resolved_request()
    run_id = record(recorder, pipeline_config, success_events(resolved), resolved)
    recorder.close()
    assert store.get_run(run_id).status == "succeeded"
    # A late event after close is still written (synchronously), not dropped.
    late = resolved_request("late")
    tracker = recorder.start_run("api", late, pipeline_config, "m", None, {})
    tracker.observe(StageStarted(late.request_id, 0, 0, kind="ar"))
    assert store.get_run(tracker.run_id).status == "running"


# -- with the real engine ---------------------------------------------------------------------------------


@pytest.fixture
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> RunStore:
    """The database several studio processes would share: PostgreSQL when the suite has it, else SQLite."""
    backend = "postgres" if os.environ.get(PG_ENV) else "sqlite"
    store = open_store(new_database_url(backend, tmp_path, request), tmp_path / "data")
    yield store
    store.close()


def test_eight_concurrent_engine_requests_are_all_recorded(tiny_engine, shared_store: RunStore) -> None:
    """The real engine serving 8 requests at once (run on one database: the engine costs seconds of CPU)."""
    from engine import GenerationParams, GenerationRequest

    store = shared_store
    recorder = RunRecorder(store)

    async def serve(i: int) -> str:
        resolved = tiny_engine.resolve(
            GenerationRequest(
                f"request {i}", GenerationParams(seed=i, num_inference_steps=1, height=32, width=32)
            )
        )
        tracker = recorder.start_run(
            "api", resolved, tiny_engine.config, "tiny-glm-image", "fp-test", {"i": i}
        )
        async for event in tiny_engine.generate(resolved):
            tracker.observe(event)
        return tracker.run_id

    async def main() -> list[str]:
        return await asyncio.gather(*(serve(i) for i in range(8)))

    ids = asyncio.run(main())
    recorder.close()
    assert recorder.errors == 0, recorder.last_error
    assert store.count_runs(RunFilter(status="succeeded")) == 8
    for i, run_id in enumerate(ids):
        run = store.get_run(run_id)
        assert (run.status, run.fingerprint, run.seed) == ("succeeded", "fp-test", i)
        assert run.config_hash == tiny_engine.config_hash
        assert {s.stage_id for s in run.stages} == {s.stage_id for s in tiny_engine.config.stages}
        assert all(s.finished_at >= s.started_at for s in run.stages)
        [picture] = run.images
        assert picture.path.exists() and picture.width and picture.height
