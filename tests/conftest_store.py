"""Fixtures of the run-store tests (loaded with ``pytest_plugins = ["conftest_store"]``).

Every store test runs twice: on a SQLite file and on the PostgreSQL server that ``scripts/test.sh``
starts (``OMNI_STUDIO_TEST_PG_URL``), each test in a schema of its own.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from engine import OmniEngine, build_engine
from engine.building import build_pipeline_config
from engine.config import PipelineConfig
from engine.events import RunFailed, RunFinished, RunOutput, StageFinished, StageStarted
from engine.models import describe_model
from engine.request import GenerationParams, GenerationRequest, ResolvedRequest
from studio.store import RunRecorder, RunStore, open_store

PG_ENV = "OMNI_STUDIO_TEST_PG_URL"
BACKENDS = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = os.environ.get(PG_ENV)
    if not url:
        message = f"{PG_ENV} is not set: scripts/test.sh starts a PostgreSQL server and sets it"
        if os.environ.get("CI"):  # CI must prove the store on PostgreSQL too, never skip it silently
            pytest.fail(message)
        pytest.skip(message)
    return url


def new_database_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A URL to an empty database: a new SQLite file, or a new PostgreSQL schema dropped afterwards."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / f'runs-{uuid.uuid4().hex[:6]}.db'}"
    admin_url = request.getfixturevalue("pg_admin_url")
    schema = f"store_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')

    def drop() -> None:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()

    request.addfinalizer(drop)
    url = make_url(admin_url).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database on each backend."""
    return new_database_url(request.param, tmp_path, request)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
def store(db_url: str, data_dir: Path) -> Iterator[RunStore]:
    store = open_store(db_url, data_dir)
    yield store
    store.close()


@pytest.fixture
def recorder(store: RunStore) -> Iterator[RunRecorder]:
    recorder = RunRecorder(store)
    yield recorder
    recorder.close()
    assert recorder.errors == 0, recorder.last_error


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniEngine]:
    """The real tiny GLM-Image engine, built once for the store tests (model cache shared with the suite)."""
    cache = os.environ.get("OMNI_STUDIO_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("models"))
    previous = os.environ.get("OMNI_STUDIO_MODEL_CACHE")
    os.environ["OMNI_STUDIO_MODEL_CACHE"] = cache
    try:
        # Batches of 4 on both stages: concurrent requests overlap in the engine as they would in a server.
        deploy = {"stages": [{"stage_id": 0, "max_num_seqs": 4}, {"stage_id": 1, "max_num_seqs": 4}]}
        engine = build_engine("tiny-glm-image", deploy, data_dir=Path(cache))
    finally:
        if previous is None:
            os.environ.pop("OMNI_STUDIO_MODEL_CACHE", None)
        else:
            os.environ["OMNI_STUDIO_MODEL_CACHE"] = previous
    yield engine
    engine.close()


# -- building requests and events by hand (the engine's own types) -------------------------------------


@pytest.fixture(scope="session")
def pipeline_config() -> PipelineConfig:
    """The tiny GLM-Image pipeline's resolved config (validated only; no model is built)."""
    return build_pipeline_config(describe_model("tiny-glm-image"))


def image(color: tuple[int, int, int], size: int = 32) -> Image.Image:
    return Image.new("RGB", (size, size), color)


def resolved_request(
    prompt: str = "a red fox",
    seed: int = 7,
    n: int = 1,
    steps: int = 4,
    source_image: Image.Image | None = None,
) -> ResolvedRequest:
    request = GenerationRequest(
        prompt, GenerationParams(seed=seed, n=n, num_inference_steps=steps), image=source_image
    )
    parameters = {
        "seed": seed,
        "n": n,
        "num_inference_steps": steps,
        "height": 32,
        "width": 32,
        "modalities": ["image"],
        "source_image": source_image is not None,
    }
    stage_params = {0: {"seed": seed}, 1: {"seed": seed, "num_inference_steps": steps}}
    return ResolvedRequest(request, seed, parameters, stage_params, ())


def success_events(resolved: ResolvedRequest, images: list[Image.Image] | None = None) -> list:
    """What the engine emits for a two-stage (AR -> diffusion) request that succeeds, per variant."""
    rid, now = resolved.request_id, time.time()
    events: list = []
    outputs = []
    for index in range(resolved.n):
        events += [
            StageStarted(rid, index, 0, kind="ar", total=16),
            StageFinished(
                rid,
                index,
                0,
                kind="ar",
                started_at=now,
                finished_at=now + 0.2,
                queue_seconds=0.01,
                input_tokens=5,
                output_tokens=16,
            ),
            StageStarted(rid, index, 1, kind="diffusion", total=4),
            StageFinished(
                rid,
                index,
                1,
                kind="diffusion",
                started_at=now + 0.2,
                finished_at=now + 0.5,
                queue_seconds=0.02,
            ),
        ]
        picture = images[index] if images else image((200, 30 + index, 40))
        outputs.append(
            RunOutput(
                index=index, seed=resolved.seed + index, images=(picture,), input_tokens=5, output_tokens=16
            )
        )
    events.append(RunFinished(rid, 0, tuple(outputs)))
    return events


def failure_events(
    resolved: ResolvedRequest, message: str = "stage 1 (diffusion) failed: boom", cancelled: bool = False
) -> list:
    rid, now = resolved.request_id, time.time()
    return [
        StageStarted(rid, 0, 0, kind="ar", total=16),
        StageFinished(rid, 0, 0, kind="ar", started_at=now, finished_at=now + 0.1, output_tokens=16),
        StageStarted(rid, 0, 1, kind="diffusion", total=4),
        StageFinished(
            rid,
            0,
            1,
            kind="diffusion",
            status="cancelled" if cancelled else "failed",
            started_at=now + 0.1,
            finished_at=now + 0.2,
        ),
        RunFailed(
            rid,
            0,
            message,
            stage_id=1,
            error_type="cancelled" if cancelled else "engine_error",
            cancelled=cancelled,
        ),
    ]


def record(
    recorder: RunRecorder,
    config: PipelineConfig,
    events: list,
    resolved: ResolvedRequest,
    source: str = "api",
    fingerprint: str | None = "omni-studio-0.1.0-abcdef12",
    model: str = "tiny-glm-image",
) -> str:
    """Record one request's events through the recorder, as an entry point would."""
    tracker = recorder.start_run(
        source,
        resolved,
        config,
        model,
        fingerprint,
        {"model": model, "prompt": resolved.request.prompt, "seed": resolved.seed},
    )
    for event in events:
        tracker.observe(event)
    return tracker.run_id
