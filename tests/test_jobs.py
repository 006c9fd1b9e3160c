"""Batch and grid jobs (docs/jobs.md): the spec and its errors, the grid, the job queue in the store, the
runner (real engines in-process), the Queue panel's rules, ``omni-studio batch``, the ``/v1/studio/jobs``
API against a live server, and a studio killed with ``kill -9`` mid-job that finishes the job after a
restart with exactly one succeeded run per cell."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from engine.models import BUILTIN_MODELS
from studio.cli import main
from studio.jobs.grid import compose_grid, grid_layout
from studio.jobs.runner import cell_request
from studio.jobs.service import JobService
from studio.jobs.spec import JobSpec, JobSpecError, load_job_file, parse_job_spec
from studio.recipes.recipe import RecipeError, read_recipe
from studio.runs.inflight import RequestBoard
from studio.runs.queue import QueueError, QueueView, Viewer
from studio.runs.service import RunService
from studio.startup.limits import InputLimits
from studio.store import RunFilter, open_store
from studio.store.jobs import JobStore
from tests.servers import start_server

pytest_plugins = ["conftest_store"]

SHAPES = "a red circle on a blue background, center"


def job_runs(stored, job_id: str) -> list:
    """Every recorded run of a job (its cells' runs, any cut-off ones, and its grid)."""
    summaries = stored.list_runs(RunFilter(source="job"), limit=1000)
    details = [stored.get_run(summary.id) for summary in summaries]
    return [run for run in details if (run.request or {}).get("job") == job_id]


def problems_of(document, limits: InputLimits | None = None) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(document, limits)
    return {problem.field: problem.message for problem in caught.value.problems}


# -- the spec -----------------------------------------------------------------------------------------


def test_spec_errors_name_the_field_and_the_allowed_values():
    problems = problems_of(
        {
            "prompts": ["a cat"],
            "x": {"param": "stepz", "values": [1]},
            "y": {"param": "steps", "values": [2, "many"]},
            "colour": 1,
        }
    )
    assert (
        "'steps', 'guidance', 'size', 'negative_prompt', 'model', 'deploy', 'voice' or 'speed'"
        in problems["x.param"]
    )
    assert problems["colour"].startswith("unknown field; the allowed fields are name, prompts, seeds, x, y")
    assert problems["y.values[1]"] == "steps must be a whole number from 1 to 1000 (--max-steps), got 'many'"

    problems = problems_of(
        {
            "prompts": ["a cat", "  "],
            "seeds": [3, 3],
            "steps": 4,
            "size": "100",
            "deploy": "gpu-x",
            "x": {"param": "steps", "values": [2, 2]},
            "y": {"param": "steps", "values": [8]},
        }
    )
    assert problems["prompts[1]"] == "is empty; give the text to generate"
    assert problems["seeds[1]"] == "repeats seed 3; each seed once"
    assert problems["steps"].startswith("is also the ") and "give it in one place" in problems["steps"]
    assert problems["x.values[1]"] == "repeats x.values[0]; each value once"
    assert problems["y.param"].startswith(
        "x already varies steps; the y axis must vary another (guidance, size"
    )
    assert problems["size"] == "'100' is not a size: give WIDTHxHEIGHT, e.g. '128x128'"
    assert "unknown deploy preset 'gpu-x'; the presets are" in problems["deploy"]
    assert "tiny-glm-shapes" in problems["deploy"]

    too_many = problems_of({"prompts": [f"p{i}" for i in range(32)], "seeds": list(range(16))})
    assert too_many[""].startswith("the job has 512 cells") and "the limit is 256" in too_many[""]
    limited = problems_of(
        {"prompts": ["a"], "x": {"param": "steps", "values": [5, 20]}}, InputLimits(max_steps=10)
    )
    assert limited == {"x.values[1]": "steps must be a whole number from 1 to 10 (--max-steps), got 20"}
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job_file("prompts: [a", "job.yaml")
    with pytest.raises(JobSpecError, match="job.yaml: a job is a mapping of fields"):
        load_job_file("- a cat", "job.yaml")


def test_cells_cover_every_prompt_seed_and_axis_value_once():
    spec = parse_job_spec(
        {
            "prompts": ["p0", "p1"],
            "seeds": [5, 6],
            "size": "64x64",
            "x": {"param": "steps", "values": [2, 4]},
            "y": {"param": "negative_prompt", "values": ["", "blurry"]},
        }
    )
    cells = spec.cells()
    assert len(cells) == spec.cell_count() == 16
    assert [c.index for c in cells] == list(range(16))
    seen = {(p.prompt, p.seed, p.steps, p.negative_prompt) for p in map(spec.parameters, cells)}
    assert seen == set(itertools.product(["p0", "p1"], [5, 6], [2, 4], ["", "blurry"]))
    assert spec.parameters(cells[0]).fields() == {
        "seed": 5,
        "num_inference_steps": 2,
        "negative_prompt": "",
        "width": 64,
        "height": 64,
    }
    assert spec.axes_of(cells[3]) == {
        "prompt_index": 0,
        "prompt": "p0",
        "seed": 5,
        "x": {"param": "steps", "index": 1, "value": 4},
        "y": {"param": "negative_prompt", "index": 1, "value": "blurry"},
    }
    pinned = parse_job_spec({"prompts": "one prompt"}).with_defaults("tiny-glm-shapes")
    assert (
        pinned.model == "tiny-glm-shapes"
        and pinned.prompts == ["one prompt"]
        and len(pinned.seeds or []) == 1
    )


# -- the grid -----------------------------------------------------------------------------------------


def _box(grid: Image.Image, colour: tuple[int, int, int]) -> tuple[int, int, int, int] | None:
    """(left, top, width, height) of the pixels of exactly ``colour``."""
    mask = np.all(np.asarray(grid) == np.array(colour, dtype=np.uint8), axis=-1)
    if not mask.any():
        return None
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)


def test_the_grid_puts_each_cell_under_its_labels():
    spec = parse_job_spec(
        {
            "name": "sweep",
            "prompts": ["a red circle", "a blue square"],
            "seeds": [1],
            "x": {"param": "guidance", "values": [1.0, 3.5]},
            "y": {"param": "steps", "values": [2, 4]},
        }
    )
    layout = grid_layout(spec, "sweep")
    assert layout.title == "sweep · seed 1"
    assert layout.columns == ["guidance 1", "guidance 3.5"]
    assert layout.rows == [
        "a red circle\nsteps 2",
        "a red circle\nsteps 4",
        "a blue square\nsteps 2",
        "a blue square\nsteps 4",
    ]
    colours = {i: (20 + i * 25, 240 - i * 25, 77) for i in range(8)}
    images = {i: Image.new("RGB", (32, 32), colours[i]) for i in range(8) if i != 5}
    grid = compose_grid(layout, images, {5: "failed"})
    boxes = {i: _box(grid, colours[i]) for i in images}
    for i, box in boxes.items():
        assert box is not None and box[2:] == (128, 128), (i, box)  # 32 px cells scaled 4x, nearest
    assert _box(grid, colours[5]) is None  # the failed cell shows its note instead
    # Cell i is at (row, column) = divmod(i, 2): same row -> same top, same column -> same left.
    for i, j in itertools.combinations(images, 2):
        (ri, ci), (rj, cj) = divmod(i, 2), divmod(j, 2)
        assert (boxes[i][1] == boxes[j][1]) == (ri == rj)
        assert (boxes[i][0] == boxes[j][0]) == (ci == cj)
        if ci < cj:
            assert boxes[i][0] < boxes[j][0]
        if ri < rj:
            assert boxes[i][1] < boxes[j][1]
    left = min(box[0] for box in boxes.values())
    labels = np.asarray(grid)[:, :left]
    assert (labels.sum(axis=-1) < 300).any()  # dark label text left of the cells
    again = compose_grid(grid_layout(spec, "sweep"), images, {5: "failed"})
    assert again.tobytes() == grid.tobytes()  # same job, same images: same grid

    seeds_across = grid_layout(parse_job_spec({"prompts": ["a", "b"], "seeds": [1, 2, 3]}), "t")
    assert seeds_across.columns == ["seed 1", "seed 2", "seed 3"] and seeds_across.rows == ["a", "b"]
    assert seeds_across.places[4] == (1, 1)


# -- the job queue in the store (SQLite and PostgreSQL) ----------------------------------------------


def test_job_store_orders_moves_cancels_and_hands_over(store):
    jobs = JobStore(store)

    def new(name: str, worker: str):
        return jobs.create_job(
            spec={"prompts": [name]},
            items=[{"i": 0}, {"i": 1}],
            source="api",
            owner="api:x",
            name=name,
            worker=worker,
        )

    a, b, c = new("a", "w-dead"), new("b", "w-live"), new("c", "w-dead")
    assert list(jobs.queue_positions()) == [a.id, b.id, c.id]
    assert jobs.move_job(c.id, -1) and list(jobs.queue_positions()) == [a.id, c.id, b.id]
    assert not jobs.move_job(a.id, -1) and not jobs.move_job(b.id, 1)  # first and last already
    assert jobs.cancel_job(b.id)
    cancelled = jobs.get_job(b.id, items=True)
    assert cancelled.status == "cancelled" and cancelled.cancelled == 2
    assert [i.status for i in cancelled.items] == ["cancelled", "cancelled"]
    assert not jobs.cancel_job(b.id)  # a finished job stays as it finished
    assert list(jobs.queue_positions()) == [a.id, c.id]
    # A new studio takes over the jobs of dead workers only, and only once.
    assert sorted(jobs.claim_orphans("w-new", lambda w: w == "w-live")) == sorted([a.id, c.id])
    assert jobs.claim_orphans("w-other", lambda w: w in ("w-live", "w-new")) == []
    # A cell's run id is written before its run; the job's counters follow the cells.
    jobs.start_item(a.id, 0, "r" * 32)
    jobs.start_item(a.id, 0, "s" * 32)  # it ran again (after a crash): attempts count
    jobs.finish_item(a.id, 0, "succeeded")
    jobs.finish_item(a.id, 1, "failed", "boom", run_id="t" * 32)
    done = jobs.get_job(a.id, items=True)
    assert (done.succeeded, done.failed, done.done) == (1, 1, 2)
    assert [(i.run_id, i.attempts, i.status) for i in done.items] == [
        ("s" * 32, 2, "succeeded"),
        ("t" * 32, 0, "failed"),
    ]
    assert jobs.finish_job(a.id, "failed", "1 of 2 cells did not succeed")
    assert [j.id for j in jobs.list_jobs(("failed",))] == [a.id]


# -- the runner with real engines ---------------------------------------------------------------------


def service_for(store, recorder, engine, **kwargs) -> JobService:
    return JobService(
        store, recorder, lambda: engine, lambda: engine.model.name, data_dir=store.data_dir, **kwargs
    )


def test_a_job_runs_each_cell_once_as_a_recorded_run_and_records_its_grid(store, recorder, diffusion_engine):
    service = service_for(store, recorder, diffusion_engine).start()
    try:
        spec = parse_job_spec(
            {
                "prompts": ["a cat", "a dog"],
                "seeds": [3],
                "size": "64x64",
                "x": {"param": "steps", "values": [1, 2]},
            }
        )
        job = service.submit(spec, "api", "api:test")
        assert service.wait(job.id, 120)
        job = service.get(job.id)
    finally:
        service.close()
    assert (job.status, job.succeeded, job.total) == ("succeeded", 4, 4)
    assert job.spec["model"] == "tiny-diffusion" and job.spec["seeds"] == [3]
    recorder.flush()
    for item in job.items:
        run = store.get_run(item.run_id)
        assert (run.status, run.source, run.request["job"], run.request["item"]) == (
            "succeeded",
            "job",
            job.id,
            item.index,
        )
        assert run.parameters["num_inference_steps"] == item.axes["x"]["value"]
        # The cell's picture is what the same request gives alone.
        params = JobSpec.model_validate(job.spec).parameters(
            JobSpec.model_validate(job.spec).cells()[item.index]
        )
        alone = diffusion_engine.run(cell_request(params)).images[0]
        with Image.open(run.outputs[0].path) as kept:
            assert kept.convert("RGB").tobytes() == alone.convert("RGB").tobytes()
    grid_run = store.get_run(job.grid_run_id)
    assert grid_run.source == "job" and grid_run.status == "succeeded"
    assert grid_run.outputs[0].sha256 == job.grid_sha256
    with Image.open(service.grid_path(job)) as grid:
        assert grid.width > 2 * 128 and grid.height > 2 * 128  # two columns, two rows of 128 px cells
        # The grid carries its job (docs/recipes.md): an A1111-style line and the spec, no clock.
        assert grid.info["parameters"].startswith(f"grid of {job.label}\nGrid: {job.label}, Prompts: ")
        carried = json.loads(grid.info["omni_studio"])
        assert carried["grid"] == job.spec and carried["job"] == job.id
    with pytest.raises(RecipeError, match="is a batch job's grid"):
        read_recipe(service.grid_path(job).read_bytes(), "grid.png")


def test_model_and_deploy_axes_run_on_engines_built_for_them(store, recorder, diffusion_engine):
    service = service_for(store, recorder, diffusion_engine).start()
    try:
        spec = parse_job_spec(
            {
                "prompts": ["a cat"],
                "seeds": [1],
                "size": "64x64",
                "steps": 2,
                "x": {"param": "model", "values": ["tiny-diffusion", "tiny-glm-image"]},
            }
        )
        models = service.submit(spec, "cli", "cli:me")
        deploy = {"stages": [{"stage_id": 0, "default_sampling_params": {"guidance_scale": 1.0}}]}
        spec = parse_job_spec(
            {
                "prompts": ["a cat"],
                "seeds": [1],
                "size": "64x64",
                "steps": 2,
                "x": {"param": "deploy", "values": ["tiny-diffusion", deploy]},
            }
        )
        deploys = service.submit(spec, "cli", "cli:me")
        assert service.wait(models.id, 180) and service.wait(deploys.id, 180)
        models, deploys = service.get(models.id), service.get(deploys.id)
    finally:
        service.close()
    assert models.status == "succeeded" and deploys.status == "succeeded"
    recorder.flush()
    runs = [store.get_run(item.run_id) for item in models.items]
    assert [r.model for r in runs] == ["tiny-diffusion", "tiny-glm-image"]
    assert [r.config["family"] for r in runs] == ["diffusion", "glm-image"]
    runs = [store.get_run(item.run_id) for item in deploys.items]
    assert [r.parameters["guidance_scale"] for r in runs] == [4.0, 1.0]  # the preset's, then the mapping's


def test_submitting_checks_every_cell_against_the_running_studio(store, recorder, diffusion_engine):
    service = service_for(store, recorder, diffusion_engine)

    def refused(document) -> dict[str, str]:
        with pytest.raises(JobSpecError) as caught:
            service.submit(parse_job_spec(document), "api", None)
        return {p.field: p.message for p in caught.value.problems}

    problems = refused({"prompts": ["a"], "x": {"param": "model", "values": ["tiny-diffusion", "nope"]}})
    assert problems == {"x.values[1]": f"unknown model 'nope'; allowed: {', '.join(sorted(BUILTIN_MODELS))}"}
    problems = refused({"prompts": ["a"], "x": {"param": "size", "values": ["64x64", "72x64"]}})
    assert problems == {"x.values[1]": "width must be a multiple of 16 for diffusion models, got 72"}
    assert "tiny-chat makes text, not images" in refused({"prompts": ["a"], "model": "tiny-chat"})["model"]
    devices = refused({"prompts": ["a"], "model": "tiny-glm-image", "deploy": "glm-image-1gpu"})["deploy"]
    assert "devices" in devices and "cpu" in devices
    assert JobStore(store).list_jobs() == []  # nothing refused was queued


def test_the_queue_panel_lists_jobs_and_requests_and_lets_only_owners_and_the_admin_change_them(
    store, recorder, diffusion_engine
):
    board = RequestBoard()
    service = service_for(store, recorder, diffusion_engine, board=board)  # not started: jobs stay queued
    view = QueueView(board, service)
    alice = Viewer.of_ui("s-alice", None, admin_user="root")
    bob = Viewer.of_ui("s-bob", None, admin_user="root")
    admin = Viewer.of_ui("s-root", "root", admin_user="root")
    assert admin.admin and not alice.admin and alice.job_owner == "ui-session:s-alice"
    spec = parse_job_spec({"prompts": ["a cat"], "seeds": [1], "size": "64x64", "steps": 1})
    a = service.submit(spec, "ui", alice.job_owner)
    b = service.submit(spec, "ui", alice.job_owner)
    c = service.submit(spec, "api", "api:127.0.0.1|-")
    rows = view.rows(bob)
    assert [(r.id, r.position, r.yours) for r in rows] == [
        (a.id, "#1", False),
        (b.id, "#2", False),
        (c.id, "#3", False),
    ]
    assert (
        rows[0].cells()[3] == "UI session s-alic"
        and view.rows(alice)[0].cells()[3] == "UI session s-alic (you)"
    )
    with pytest.raises(QueueError, match="only its owner or the admin login"):
        view.cancel(bob, a.id)
    with pytest.raises(QueueError, match="belongs to API 127.0.0.1"):
        view.move(alice, c.id[:12], -1)
    assert view.move(alice, b.id[:12], -1) == "Job " + b.label + " is now #1 in the queue."
    assert view.cancel(admin, c.id).startswith("Cancelled job")  # the admin may cancel anyone's
    assert "cancelled" in view.cancel(alice, a.id).lower()
    assert [r.id for r in view.rows(alice)] == [b.id]
    with pytest.raises(QueueError, match="Nothing with id"):
        view.cancel(alice, a.id)

    # A single request shows while it is in the engine (source, owner, progress), and only its owner
    # (or the admin) may cancel it.
    runs = RunService(recorder, "api", store.files, board=board)
    seen = []

    async def one_request() -> None:
        resolved = runs.resolve(
            diffusion_engine, cell_request(spec.parameters(spec.with_defaults("x").cells()[0]))
        )
        tracker = runs.start(diffusion_engine, resolved, "tiny-diffusion", None, {"prompt": "a cat"})
        async for _event in runs.events(diffusion_engine, resolved, tracker, client="10.0.0.9|-"):
            rows = [r for r in view.rows(bob) if r.kind == "request"]
            seen.append((rows[0].source, rows[0].owner, rows[0].progress, rows[0].yours) if rows else None)
            if len(seen) == 1:
                with pytest.raises(QueueError, match="belongs to API 10.0.0.9"):
                    view.cancel(bob, resolved.request_id)

    asyncio.run(one_request())
    assert seen[0][:2] == ("api", "api:10.0.0.9|-") and not seen[0][3]
    assert any(entry and "stage 1/1" in entry[2] for entry in seen)
    assert [r for r in view.rows(bob) if r.kind == "request"] == []  # gone once it ended


# -- omni-studio batch -------------------------------------------------------------------------------


def test_cli_batch_shows_progress_and_prints_the_grid_path(tmp_path, capfd):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "cli sweep",
                "prompts": ["a cat"],
                "seeds": [1, 2],
                "size": "64x64",
                "x": {"param": "steps", "values": [1, 2]},
            }
        )
    )
    data = tmp_path / "data"
    out = tmp_path / "grid.png"
    code = main(
        ["batch", str(job_file), "--model", "tiny-diffusion", "--data-dir", str(data), "--out", str(out)]
    )
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip().splitlines()[-1] == str(out)
    assert "4 cells (cli sweep)" in captured.err and "cells: 100%" in captured.err
    assert "succeeded: 4/4 cells succeeded" in captured.err
    with Image.open(out) as grid:
        assert grid.format == "PNG" and grid.width > 2 * 128
    with open_store(None, data) as stored:
        job = JobStore(stored).list_jobs()[0]
        assert (job.source, job.status) == ("cli", "succeeded") and job.owner.startswith("cli:")
        runs = stored.list_runs(RunFilter(source="job"), limit=20)
        assert Counter(r.status for r in runs) == {"succeeded": 5}  # 4 cells and the grid

    bad = tmp_path / "bad.yaml"
    bad.write_text("prompts: [a cat]\nx: {param: steps, values: [2, lots]}\n")
    assert main(["batch", str(bad), "--data-dir", str(data)]) == 2
    err = capfd.readouterr().err
    assert (
        "bad.yaml: x.values[1]: steps must be a whole number from 1 to 1000 (--max-steps), got 'lots'" in err
    )


def test_cli_batch_resume_finishes_a_job_a_dead_process_left(tmp_path, capfd):
    data = tmp_path / "data"
    spec = parse_job_spec(
        {"prompts": ["a cat"], "seeds": [4], "size": "64x64", "x": {"param": "steps", "values": [1, 2]}}
    )
    spec = spec.with_defaults("tiny-diffusion")
    with open_store(None, data) as stored:
        jobs = JobStore(stored)
        dead = f"{os.uname().nodename}|999999|1|gone"  # a worker process that no longer exists
        job = jobs.create_job(
            spec=spec.model_dump(mode="json"),
            items=[spec.axes_of(c) for c in spec.cells()],
            source="cli",
            owner="cli:me",
            worker=dead,
        )
        jobs.mark_running(job.id)
        jobs.start_item(job.id, 0, "f" * 32)  # cut off before its run was recorded
    assert main(["batch", "--resume", job.id, "--data-dir", str(data), "--quiet"]) == 0, (
        capfd.readouterr().err
    )
    with open_store(None, data) as stored:
        done = JobStore(stored).get_job(job.id, items=True)
        assert done.status == "succeeded" and [i.attempts for i in done.items] == [2, 1]
        assert all(stored.get_run(i.run_id).status == "succeeded" for i in done.items)
    assert main(["batch", "--resume", job.id, "--data-dir", str(data)]) == 2
    assert "is finished (succeeded)" in capfd.readouterr().err


# -- the API against a live studio, and kill -9 -------------------------------------------------------

KEY = "job-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SERVE = ["serve", "--model", "tiny-glm-shapes", "--api-key", KEY]


class Studio:
    """The module's live server; the restart test replaces it with its successor on the same data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server = start_server(SERVE, data_dir)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.server.url + path, headers=HEADERS, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**HEADERS, **kwargs.pop("headers", {})}
        return httpx.post(self.server.url + path, headers=headers, timeout=30, **kwargs)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.server.url + path, headers=HEADERS, timeout=30)

    def wait(self, job_id: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get(f"/v1/studio/jobs/{job_id}").json()
            if job["status"] not in ("queued", "running"):
                return job
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not finish: {job['progress']}\n{self.server.log()[-3000:]}")


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    live = Studio(tmp_path_factory.mktemp("jobs-studio"))
    yield live
    live.server.stop()


def grid_job(**extra) -> dict:
    return {
        "prompts": [SHAPES],
        "seeds": [7],
        "size": "64x64",
        "x": {"param": "steps", "values": [2, 4]},
        "y": {"param": "guidance", "values": [1.0, 3.0]},
        **extra,
    }


def test_api_creates_lists_cancels_and_serves_the_grid(studio):
    assert httpx.post(studio.server.url + "/v1/studio/jobs", json=grid_job()).status_code == 401
    first = studio.post("/v1/studio/jobs", json=grid_job(name="api grid"))
    assert first.status_code == 200, first.text
    job = first.json()
    assert (
        job["object"] == "studio.job" and job["source"] == "api" and job["owner"].startswith("api:127.0.0.1")
    )
    assert (
        job["progress"]["total"] == 4 and job["spec"]["model"] == "tiny-glm-shapes" and job["position"] == 1
    )
    assert [item["axes"]["x"]["value"] for item in job["items"]] == [2, 4, 2, 4]
    # A second job waits behind the first; cancelled while queued, none of its cells ever runs.
    second = studio.post("/v1/studio/jobs", json=grid_job(seeds=[8, 9])).json()
    assert second["status"] == "queued" and second["position"] == 2
    cancelled = studio.delete(f"/v1/studio/jobs/{second['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["progress"]["cancelled"] == 8
    again = studio.delete(f"/v1/studio/jobs/{second['id']}")
    assert again.status_code == 400 and again.json()["error"]["code"] == "job_finished"
    assert again.json()["error"]["param"] == "job_id"
    listed = studio.get("/v1/studio/jobs", params={"status": "cancelled"}).json()
    assert [j["id"] for j in listed["data"]] == [second["id"]]
    bad_status = studio.get("/v1/studio/jobs", params={"status": "done"})
    assert bad_status.status_code == 400 and bad_status.json()["error"]["param"] == "status"
    assert "queued, running, succeeded, failed, cancelled" in bad_status.json()["error"]["message"]
    assert studio.get(f"/v1/studio/jobs/{second['id']}/grid").json()["error"]["code"] == "grid_not_ready"

    done = studio.wait(job["id"])
    assert done["status"] == "succeeded" and done["progress"]["succeeded"] == 4 and done["position"] is None
    grid = studio.get(f"/v1/studio/jobs/{job['id']}/grid")
    assert grid.status_code == 200 and grid.headers["content-type"] == "image/png"
    with Image.open(io.BytesIO(grid.content)) as image:
        assert image.width > 2 * 128 and image.height > 2 * 128
    by_url = httpx.get(done["grid"]["url"], timeout=30)  # signed: works without the key
    assert by_url.status_code == 200 and by_url.content == grid.content
    missing = studio.get("/v1/studio/jobs/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"
    with open_store(None, studio.data_dir) as stored:
        runs = [stored.get_run(item["run_id"]) for item in done["items"]]
        assert [r.status for r in runs] == ["succeeded"] * 4 and {r.source for r in runs} == {"job"}
        assert stored.get_run(done["grid"]["run_id"]).outputs[0].sha256 == done["grid"]["sha256"]
        assert job_runs(stored, second["id"]) == []


def test_api_refuses_a_bad_job_naming_the_field_and_the_allowed_values(studio):
    bad = studio.post("/v1/studio/jobs", json=grid_job(x={"param": "steps", "values": [2, "four"]}))
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "x.values[1]" and error["code"] == "invalid_job"
    assert "steps must be a whole number from 1 to 1000" in error["message"]
    model = studio.post("/v1/studio/jobs", json=grid_job(model="tiny-glm-giant")).json()["error"]
    assert (
        model["param"] == "model"
        and "allowed: tiny-chat, tiny-diffusion, tiny-glm-image, tiny-glm-shapes" in model["message"]
    )
    size = studio.post("/v1/studio/jobs", json=grid_job(size="48x64")).json()["error"]
    assert size["param"] == "size" and "multiple of 32" in size["message"]
    unknown = studio.post("/v1/studio/jobs", json={"prompts": ["a"], "prompt": "b"}).json()["error"]
    assert unknown["param"] == "prompt" and "allowed fields are name, prompts" in unknown["message"]
    not_json = studio.post("/v1/studio/jobs", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    document = httpx.get(studio.server.url + "/openapi.json", timeout=30).json()
    create = document["paths"]["/v1/studio/jobs"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobSpec"
    }
    assert {p["name"] for p in document["paths"]["/v1/studio/jobs"]["get"]["parameters"]} == {
        "status",
        "limit",
    }
    assert set(document["paths"]["/v1/studio/jobs/{job_id}"]) == {"get", "delete"}
    assert document["paths"]["/v1/studio/jobs/{job_id}"]["delete"]["security"] == [{"bearer": []}]
    assert (
        studio.get("/v1/studio/jobs", params={"status": "failed"}).json()["data"] == []
    )  # nothing refused was queued


def kill_mid_job(studio: Studio, job_id: str, at_least: int) -> tuple[dict[int, str], list[int]]:
    """``kill -9`` the studio once ``at_least`` cells of the job have succeeded while others are cut off
    in the engine. Each look freezes the server (SIGSTOP) first, so what the store says is exactly what the
    kill cuts: no cell can finish between the look and the kill, however fast or slow the machine.
    Returns the succeeded cells (index -> run id) and the indices of the cut-off ones."""
    pid = studio.server.pid
    store = open_store(None, studio.data_dir)
    deadline = time.monotonic() + 180  # only stops a hang
    try:
        while True:
            os.kill(pid, signal.SIGSTOP)
            try:
                items = JobStore(store).items(job_id)
                succeeded = {i.index: i.run_id for i in items if i.status == "succeeded"}
                # running cells whose run has not (as far as the store knows) succeeded: after the kill
                # they are interrupted and run again
                cut = [
                    i.index
                    for i in items
                    if i.status == "running" and run_status(store, i.run_id) != "succeeded"
                ]
                if len(succeeded) >= at_least and cut:
                    os.kill(pid, signal.SIGKILL)
                    return succeeded, cut
                assert len(succeeded) < len(items), "the job finished before the test saw it part-way"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            assert time.monotonic() < deadline, f"the job did not get part-way: {items}"
            time.sleep(0.05)
    finally:
        store.close()


def run_status(store, run_id: str | None) -> str | None:
    from studio.store.errors import RunNotFound

    try:
        return store.get_run(run_id).status if run_id else None
    except RunNotFound:
        return None


def test_a_job_killed_mid_run_resumes_after_a_restart_with_one_run_per_cell(studio):
    """kill -9 while cells are in the engine; the next studio on the same data dir finishes the job: every
    cell ends with exactly one succeeded run, none is missing, the cut-off runs are recorded interrupted."""
    # 16 cells, run a few at a time: the job takes many times longer than one look at it.
    seeds = [1, 2, 3, 4]
    spec = grid_job(prompts=[SHAPES, "a green square on a yellow background, top left"], seeds=seeds, y=None)
    job = studio.post("/v1/studio/jobs", json=spec).json()
    total = 2 * len(seeds) * 2
    assert job["progress"]["total"] == total
    before, cut = kill_mid_job(studio, job["id"], at_least=2)
    studio.server.process.wait(timeout=30)

    studio.server = start_server(SERVE, studio.data_dir)  # the same data dir: it takes the job over
    done = studio.wait(job["id"])
    assert done["status"] == "succeeded" and done["progress"]["succeeded"] == total, done["progress"]
    items = {item["index"]: item for item in done["items"]}
    assert all(items[i]["run_id"] == run_id for i, run_id in before.items())  # finished cells never re-ran
    assert all(items[i]["attempts"] == 2 for i in cut)  # the cut-off cells ran again
    with open_store(None, studio.data_dir) as stored:
        runs = job_runs(stored, job["id"])
        grids = [r for r in runs if r.request.get("grid")]
        cells = [r for r in runs if not r.request.get("grid")]
        succeeded = Counter(r.request["item"] for r in cells if r.status == "succeeded")
        assert succeeded == {index: 1 for index in range(total)}  # no duplicate, none missing
        assert {r.id for r in cells if r.status == "succeeded"} == {item["run_id"] for item in done["items"]}
        assert {r.status for r in cells} <= {"succeeded", "interrupted"}
        assert len(grids) == 1 and grids[0].outputs[0].sha256 == done["grid"]["sha256"]
    assert studio.get(f"/v1/studio/jobs/{job['id']}/grid").status_code == 200
