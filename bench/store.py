"""Run-store benchmark: recording overhead per run (target < 5 ms median) and the History tab's query
over N runs (target < 100 ms, up to 1,000,000 runs), on SQLite and, when OMNI_STUDIO_TEST_PG_URL is set,
PostgreSQL.

Recording overhead: one run's whole recording through RunRecorder (create, running, two stage rows, one
64x64 PNG output, finish), from start_run until flush() returns, runs one after another. The image's PNG
is encoded beforehand, as the API does for its response (png_bytes caches it); the figure with the encoding
is printed too. The caller-side cost (what an event loop spends in start_run/observe) is printed as well.

History query: the History tab's page (list_page: newest 50, and count_matching: exact up to 10,000)
with a prompt search, a status, a model and a date filter, over ``--history`` runs with stages and outputs
(generated in bulk: 1,000,000 in a few minutes); also its "load more" page, a rare and a two-letter
search, and no filter. Prints median and range, and the database size per 100k runs.

    .venv/bin/python bench/store.py [--runs 200] [--history 10000] [--only sqlite|postgresql]
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
from sqlalchemy import create_engine  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from engine.building import build_pipeline_config  # noqa: E402
from engine.events import RunFinished, RunOutput, StageFinished, StageStarted  # noqa: E402
from engine.models import describe_model  # noqa: E402
from engine.request import GenerationParams, GenerationRequest, ResolvedRequest  # noqa: E402
from studio.media.images import png_bytes  # noqa: E402
from studio.store import RunFilter, RunRecorder, RunStore, open_store  # noqa: E402

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


def _history_rows(count: int, config_hash: str, start: int, stop: int, rng: random.Random, now: datetime):
    """Rows of runs ``start..stop`` (37 s apart, newest first) with two stages and one output each."""
    statuses = ["succeeded"] * 8 + ["failed", "cancelled"]
    models = ["tiny-glm-image", "tiny-chat", "tiny-diffusion"]
    sources = ["ui", "api", "cli"]
    runs, stages, outputs = [], [], []
    for i in range(start, stop):
        run_id = uuid.UUID(int=rng.getrandbits(128), version=4).hex
        created = (now - timedelta(seconds=i * 37)).replace(tzinfo=None)
        finished = created + timedelta(seconds=1)
        runs.append(
            (
                run_id,
                rng.choice(sources),
                created,
                created,
                finished,
                rng.choice(statuses),
                " ".join(rng.choices(WORDS, k=8)) + (" watercolor" if rng.random() < 0.001 else ""),
                rng.choice(models),
                f'{{"seed": {i}}}',
                f'{{"seed": {i}, "n": 1}}',
                i,
                config_hash,
                "omni-studio-0.1.0-abcd1234",
            )
        )
        stages.append((run_id, 0, 0, "ar", "succeeded", created, created, 0.0, 5, 16, 1))
        stages.append((run_id, 0, 1, "diffusion", "succeeded", created, finished, 0.0, 0, 0, 1))
        outputs.append((run_id, 0, "image", f"{i:064x}", "image/png", 64, 64, 4096))
    return runs, stages, outputs


RUN_COLUMNS = (
    "id, source, created_at, started_at, finished_at, status, prompt, model, request, parameters, seed, "
    "config_hash, fingerprint"
)
STAGE_COLUMNS = (
    "run_id, variant_index, stage_id, kind, status, started_at, finished_at, queue_seconds, input_tokens, "
    "output_tokens, batch_size"
)
OUTPUT_COLUMNS = 'run_id, "index", kind, sha256, mime, width, height, size_bytes'


def fill_history(store: RunStore, count: int, chunk: int = 20_000) -> float:
    """``count`` finished runs with two stages and one output each, written in bulk; returns seconds.

    Straight through the driver (SQLite: executemany in one transaction; PostgreSQL: COPY), as a
    million rows through the ORM would take longer than the benchmark itself. The store's own triggers
    keep the search index in sync as on any insert.
    """
    started = time.perf_counter()
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
    sqlite = store.dialect == "sqlite"
    with store.engine.begin() as connection:
        driver = connection.connection.driver_connection
        cursor = driver.cursor()
        for start in range(0, count, chunk):
            runs, stages, outputs = _history_rows(
                count, config.config_hash(), start, min(count, start + chunk), rng, now
            )
            if sqlite:
                # SQLAlchemy's SQLite DateTime is ISO text with a space and microseconds.
                def stamp(value: datetime) -> str:
                    return value.strftime("%Y-%m-%d %H:%M:%S.%f")

                runs = [(*r[:2], stamp(r[2]), stamp(r[3]), stamp(r[4]), *r[5:]) for r in runs]
                stages = [(*s[:5], stamp(s[5]), stamp(s[6]), *s[7:]) for s in stages]
                cursor.executemany(f"INSERT INTO runs ({RUN_COLUMNS}) VALUES ({', '.join('?' * 13)})", runs)
                cursor.executemany(
                    f"INSERT INTO run_stages ({STAGE_COLUMNS}) VALUES ({', '.join('?' * 11)})", stages
                )
                cursor.executemany(
                    f"INSERT INTO outputs ({OUTPUT_COLUMNS}) VALUES ({', '.join('?' * 8)})", outputs
                )
            else:
                for table, columns, rows in (
                    ("runs", RUN_COLUMNS, runs),
                    ("run_stages", STAGE_COLUMNS, stages),
                    ("outputs", OUTPUT_COLUMNS, outputs),
                ):
                    with cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                        for row in rows:
                            copy.write_row(row)
    store.delete_run(seed_run)
    # What the docs recommend after a bulk import: fresh planner statistics.
    store.maintain()
    return time.perf_counter() - started


def bench_query(store: RunStore, repeats: int = 20) -> dict[str, tuple[float, float, float, int]]:
    """The History tab's queries: ``{name: (median ms, min, max, matches)}``.

    ``page``: newest 50 + the capped count with a prompt search, a status, a model and a date filter.
    ``load more``: the next 50 of the same (keyset cursor). ``rare``: a word in 0.1% of the prompts.
    ``short``: a two-letter search (below the trigram index: scanned). ``all``: no filter at all.
    """
    since = datetime.now(UTC) - timedelta(days=30)
    queries = {
        "page": RunFilter(search="fox", status="succeeded", model="tiny-glm-image", since=since),
        "rare": RunFilter(search="watercolor"),
        "short": RunFilter(search="ow", status="failed"),
        "all": RunFilter(),
    }
    results: dict[str, tuple[float, float, float, int]] = {}
    for name, selection in queries.items():
        times, found, cursor = [], 0, None
        for i in range(repeats + 3):
            started = time.perf_counter()
            page = store.list_page(selection, limit=50)
            count = store.count_matching(selection)
            elapsed = (time.perf_counter() - started) * 1000
            found, cursor = count.value, page.next_cursor
            assert len(page.runs) == min(50, found)
            if i >= 3:
                times.append(elapsed)
        results[name] = (statistics.median(times), min(times), max(times), found)
        if name == "page" and cursor:
            times = []
            for i in range(repeats + 3):
                started = time.perf_counter()
                store.list_page(selection, limit=50, cursor=cursor)
                if i >= 3:
                    times.append((time.perf_counter() - started) * 1000)
            results["load more"] = (statistics.median(times), min(times), max(times), found)
    return results


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
    parser.add_argument("--only", choices=["sqlite", "postgresql"], help="one backend only")
    args = parser.parse_args()
    if not os.environ.get("OMNI_STUDIO_TEST_PG_URL"):
        print("(OMNI_STUDIO_TEST_PG_URL not set: SQLite only)")

    rows = []
    for name, url, cleanup in backends():
        if args.only and name != args.only:
            cleanup()
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                store = open_store(url, Path(tmp) / "data")
                try:
                    record_ms, caller_ms = bench_recording(store, args.runs, pre_encoded=True)
                    record_png_ms, _ = bench_recording(store, max(20, args.runs // 4), pre_encoded=False)
                    fill_s = fill_history(store, args.history)
                    size = store.database_bytes() or 0
                    queries = bench_query(store)
                finally:
                    store.close()
            finally:
                cleanup()
        rows.append((name, record_ms, record_png_ms, caller_ms, fill_s, size, queries))
        print(f"  ({name}: {args.history:,} runs generated in {fill_s:.1f} s)", flush=True)

    print(f"\nrecording overhead per run (median of {args.runs}; target < {RECORD_TARGET_MS:g} ms)")
    for name, record_ms, record_png_ms, caller_ms, *_ in rows:
        print(
            f"  {name:<10} {record_ms:6.2f} ms  ratio to target {record_ms / RECORD_TARGET_MS:4.2f}"
            f"   | with PNG encoding {record_png_ms:6.2f} ms | caller (event loop) {caller_ms:5.3f} ms"
        )
    print(
        f"\nHistory tab over {args.history:,} runs: newest 50 + count capped at 10,000 "
        f"(median of 20 [min-max]; target < {QUERY_TARGET_MS:g} ms)"
    )
    for name, *_, size, queries in rows:
        for query, (median, low, high, found) in queries.items():
            matches = f"{found:,}" + ("" if found < 10_000 or query == "load more" else "+")
            print(
                f"  {name:<10} {query:<9} {median:7.2f} ms [{low:.1f}-{high:.1f}]"
                f"  ratio to target {median / QUERY_TARGET_MS:4.2f}   ({matches} matching runs)"
            )
        print(
            f"  {name:<10} database size {size / 2**20:,.1f} MiB = "
            f"{size / 2**20 / max(1, args.history) * 100_000:,.1f} MiB per 100k runs"
        )


if __name__ == "__main__":
    main()
