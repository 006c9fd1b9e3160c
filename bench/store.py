"""Run-store benchmark: recording overhead per run (target < 5 ms median) and a filtered history query
over 10,000 runs (target < 100 ms), on SQLite and, when OMNI_STUDIO_TEST_PG_URL is set, PostgreSQL.

Recording overhead: one run's whole recording through RunRecorder (create, running, two stage rows, one
64x64 PNG output, finish), from start_run until flush() returns, runs one after another. The image's PNG
is encoded beforehand, as the API does for its response (png_bytes caches it); the figure with the encoding
is printed too. The caller-side cost (what an event loop spends in start_run/observe) is printed as well.

History query: list_runs (newest 50) + count_runs with a prompt search, a status and a model filter, the
UI's history page, over 10,000 runs with stages and outputs.

    .venv/bin/python bench/store.py [--runs 200] [--history 10000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image  # noqa: E402
from sqlalchemy import create_engine, insert  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from engine.engine import build_pipeline_config  # noqa: E402
from engine.events import RunFinished, RunOutput, StageFinished, StageStarted  # noqa: E402
from engine.models import describe_model  # noqa: E402
from engine.request import GenerationParams, GenerationRequest, ResolvedRequest  # noqa: E402
from studio.media import png_bytes  # noqa: E402
from studio.store import RunFilter, RunRecorder, RunStore, open_store  # noqa: E402
from studio.store.models import Output, Run, RunStage  # noqa: E402

RECORD_TARGET_MS = 5.0
QUERY_TARGET_MS = 100.0
WORDS = [
    "red",
    "fox",
    "cat",
    "owl",
    "blue",
    "sky",
    "snow",
    "forest",
    "city",
    "night",
    "portrait",
    "castle",
    "river",
    "mountain",
    "robot",
]


def resolved(i: int) -> ResolvedRequest:
    request = GenerationRequest(f"a red fox number {i}", GenerationParams(seed=i, num_inference_steps=4))
    parameters = {
        "seed": i,
        "n": 1,
        "num_inference_steps": 4,
        "height": 64,
        "width": 64,
        "modalities": ["image"],
    }
    return ResolvedRequest(request, i, parameters, {0: {"seed": i}, 1: {"seed": i}}, ())


def events(r: ResolvedRequest, picture: Image.Image) -> list:
    rid, now = r.request_id, time.time()
    return [
        StageStarted(rid, 0, 0, kind="ar", total=16),
        StageFinished(rid, 0, 0, kind="ar", started_at=now, finished_at=now + 0.2, output_tokens=16),
        StageStarted(rid, 0, 1, kind="diffusion", total=4),
        StageFinished(rid, 0, 1, kind="diffusion", started_at=now + 0.2, finished_at=now + 0.4),
        RunFinished(rid, 0, (RunOutput(0, r.seed, images=(picture,), output_tokens=16),)),
    ]


def noise_image(seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (64, 64), bytes(rng.getrandbits(8) for _ in range(64 * 64 * 3)))


def bench_recording(store: RunStore, runs: int, pre_encoded: bool) -> tuple[float, float]:
    """Median ms per run (start_run .. flush) and median ms spent in the caller."""
    config = build_pipeline_config(describe_model("tiny-glm-image"))
    recorder = RunRecorder(store)
    totals, callers = [], []
    try:
        for i in range(runs + 10):
            picture = noise_image(i)
            if pre_encoded:
                png_bytes(picture)
            r = resolved(i)
            started = time.perf_counter()
            tracker = recorder.start_run(
                "api",
                r,
                config,
                "tiny-glm-image",
                "omni-studio-0.1.0-abcd1234",
                {"model": "tiny-glm-image", "prompt": r.request.prompt},
            )
            for event in events(r, picture):
                tracker.observe(event)
            enqueued = time.perf_counter()
            recorder.flush()
            done = time.perf_counter()
            if i >= 10:  # warm-up: first connections, statement caches, the snapshot insert
                totals.append((done - started) * 1000)
                callers.append((enqueued - started) * 1000)
    finally:
        recorder.close()
    assert recorder.errors == 0, recorder.last_error
    return statistics.median(totals), statistics.median(callers)


def fill_history(store: RunStore, count: int) -> None:
    """``count`` finished runs with two stages and one output each, written in bulk."""
    config = build_pipeline_config(describe_model("tiny-glm-image"))
    seed_run = store.create_run(
        source="api",
        prompt="seed",
        model="tiny-glm-image",
        request={},
        parameters={},
        config=config.to_dict(),
        config_hash=config.config_hash(),
    )
    rng = random.Random(0)
    now = datetime.now(UTC)
    statuses = ["succeeded"] * 8 + ["failed", "cancelled"]
    models = ["tiny-glm-image", "tiny-chat", "tiny-diffusion"]
    with store.engine.begin() as connection:
        for start in range(0, count, 1000):
            runs, stages, outputs = [], [], []
            for i in range(start, min(count, start + 1000)):
                run_id = uuid.uuid4().hex
                created = now - timedelta(seconds=i * 37)
                runs.append(
                    {
                        "id": run_id,
                        "source": rng.choice(["ui", "api", "cli"]),
                        "created_at": created,
                        "started_at": created,
                        "finished_at": created + timedelta(seconds=1),
                        "status": rng.choice(statuses),
                        "prompt": " ".join(rng.choices(WORDS, k=8)),
                        "model": rng.choice(models),
                        "request": {"seed": i},
                        "parameters": {"seed": i, "n": 1},
                        "seed": i,
                        "config_hash": config.config_hash(),
                        "fingerprint": "omni-studio-0.1.0-abcd1234",
                    }
                )
                for stage_id, kind in ((0, "ar"), (1, "diffusion")):
                    stages.append(
                        {
                            "run_id": run_id,
                            "variant_index": 0,
                            "stage_id": stage_id,
                            "kind": kind,
                            "status": "succeeded",
                            "started_at": created,
                            "finished_at": created,
                            "queue_seconds": 0.0,
                            "input_tokens": 5,
                            "output_tokens": 16,
                            "batch_size": 1,
                        }
                    )
                outputs.append(
                    {
                        "run_id": run_id,
                        "index": 0,
                        "kind": "image",
                        "sha256": f"{i:064x}",
                        "mime": "image/png",
                        "width": 64,
                        "height": 64,
                        "size_bytes": 4096,
                    }
                )
            connection.execute(insert(Run), runs)
            connection.execute(insert(RunStage), stages)
            connection.execute(insert(Output), outputs)
    store.delete_run(seed_run)


def bench_query(store: RunStore, repeats: int = 20) -> tuple[float, int]:
    selection = RunFilter(
        search="fox", status="succeeded", model="tiny-glm-image", since=datetime.now(UTC) - timedelta(days=30)
    )
    times, found = [], 0
    for i in range(repeats + 3):
        started = time.perf_counter()
        page = store.list_runs(selection, limit=50)
        found = store.count_runs(selection)
        elapsed = (time.perf_counter() - started) * 1000
        assert len(page) == min(50, found)
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times), found


def backends() -> list[tuple[str, str | None, callable]]:
    """(name, url, cleanup) per backend; PostgreSQL gets a schema of its own, dropped afterwards."""
    result: list = [("sqlite", None, lambda: None)]
    pg_url = os.environ.get("OMNI_STUDIO_TEST_PG_URL")
    if pg_url:
        schema = f"store_bench_{uuid.uuid4().hex[:8]}"
        admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')

        def drop() -> None:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
            admin.dispose()

        url = make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
        result.append(("postgresql", url.render_as_string(hide_password=False), drop))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs recorded for the overhead figure")
    parser.add_argument(
        "--history", type=int, default=10_000, help="runs in the database for the query figure"
    )
    args = parser.parse_args()
    if not os.environ.get("OMNI_STUDIO_TEST_PG_URL"):
        print("(OMNI_STUDIO_TEST_PG_URL not set: SQLite only)")

    rows = []
    for name, url, cleanup in backends():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                store = open_store(url, Path(tmp) / "data")
                try:
                    record_ms, caller_ms = bench_recording(store, args.runs, pre_encoded=True)
                    record_png_ms, _ = bench_recording(store, max(20, args.runs // 4), pre_encoded=False)
                    fill_history(store, args.history)
                    query_ms, found = bench_query(store)
                finally:
                    store.close()
            finally:
                cleanup()
        rows.append((name, record_ms, record_png_ms, caller_ms, query_ms, found))

    print(f"\nrecording overhead per run (median of {args.runs}; target < {RECORD_TARGET_MS:g} ms)")
    for name, record_ms, record_png_ms, caller_ms, *_ in rows:
        print(
            f"  {name:<10} {record_ms:6.2f} ms  ratio to target {record_ms / RECORD_TARGET_MS:4.2f}"
            f"   | with PNG encoding {record_png_ms:6.2f} ms | caller (event loop) {caller_ms:5.3f} ms"
        )
    print(
        f"\nfiltered history query over {args.history:,} runs: list 50 + count "
        f"(median of 20; target < {QUERY_TARGET_MS:g} ms)"
    )
    for name, *_, query_ms, found in rows:
        print(
            f"  {name:<10} {query_ms:6.2f} ms  ratio to target {query_ms / QUERY_TARGET_MS:4.2f}"
            f"   ({found:,} matching runs)"
        )


if __name__ == "__main__":
    main()
