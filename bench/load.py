"""Load: N requests at concurrency C against a real `omni-studio serve`, mixed streaming and non-streaming,
a share of them malformed; counts by status, p50/p95 latency, and the store check (each request <-> exactly
one recorded run). Target: 0 x 5xx, 0 lost runs.

    .venv/bin/python bench/load.py [--requests 200] [--concurrency 16] [--malformed 0.1] [--model tiny-glm-image]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import running_server  # noqa: E402

GOOD = {
    "messages": [{"role": "user", "content": "a red circle on a blue background"}],
    "height": 64,
    "width": 64,
    "num_inference_steps": 4,
}
MALFORMED = [
    b"{not json",
    b"[" * 20000 + b"]" * 20000,
    json.dumps({"messages": [{"role": "user", "content": "x"}], "size": "9" * 5000 + "x32"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "a red circle \ud800"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "height": "tall"}).encode(),
    json.dumps({"messages": []}).encode(),
]


def one_request(
    client: httpx.Client, index: int, rng: random.Random, malformed_share: float, clients: int
) -> dict:
    started = time.perf_counter()
    malformed = rng.random() < malformed_share
    stream = not malformed and rng.random() < 0.5
    if malformed:
        body = rng.choice(MALFORMED)
    else:
        body = json.dumps({**GOOD, "seed": index, "stream": stream}).encode()
    # One client each (the server's per-client in-flight limit keys on the bearer token it is sent).
    headers = {"content-type": "application/json", "authorization": f"Bearer load-client-{index % clients}"}
    run_id = None
    server_error = False
    with client.stream("POST", "/v1/chat/completions", content=body, headers=headers) as response:
        text = response.read().decode(errors="replace")
        status = response.status_code
        run_id = response.headers.get("x-run-id")
    if status >= 500 or '"internal_error"' in text or '"engine_error"' in text:
        server_error = True
    return {
        "status": status,
        "seconds": time.perf_counter() - started,
        "malformed": malformed,
        "stream": stream,
        "run_id": run_id,
        "server_error": server_error,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests")
    parser.add_argument("--model", default="tiny-glm-image")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from studio.store import open_store

    data_dir = Path(tempfile.mkdtemp(prefix="omni-load-"))
    rng = random.Random(args.seed)
    with running_server(["serve", "--model", args.model], data_dir) as server:
        client = httpx.Client(base_url=server.url, timeout=600)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            seeds = [random.Random(rng.random()) for _ in range(args.requests)]
            results = list(
                pool.map(
                    lambda i: one_request(client, i, seeds[i], args.malformed, args.concurrency),
                    range(args.requests),
                )
            )
        wall = time.perf_counter() - started
        healthy = client.get("/health").status_code == 200
    store = open_store(None, data_dir)
    try:
        recorded = store.count_runs()
        ids = [r["run_id"] for r in results if r["run_id"]]
        found = store.existing_ids(ids)
    finally:
        store.close()

    by_status: dict[int, int] = {}
    for r in results:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    ok = [r["seconds"] for r in results if r["status"] == 200]
    print(f"{args.requests} requests at concurrency {args.concurrency} on {args.model} in {wall:.1f} s")
    print(f"  by status: {dict(sorted(by_status.items()))}")
    print(
        f"  malformed: {sum(r['malformed'] for r in results)}, streaming: {sum(r['stream'] for r in results)}"
    )
    if ok:
        print(f"  200s: p50 {statistics.median(ok):.2f} s, p95 {percentile(ok, 0.95):.2f} s")
    server_errors = sum(r["server_error"] for r in results)
    print(f"  5xx or engine/internal errors: {server_errors}")
    missing_ids = len(results) - len(ids)
    lost = len(ids) - len(found)
    print(
        f"  store: {recorded} runs recorded for {len(results)} requests; {missing_ids} responses without a run id; "
        f"{lost} run ids not in the store"
    )
    print(f"  healthy after: {healthy}")
    verdict = server_errors == 0 and recorded == len(results) and missing_ids == 0 and lost == 0 and healthy
    print(f"  target (0 x 5xx, 0 lost runs): {'met' if verdict else 'NOT met'}")


if __name__ == "__main__":
    main()
