"""Throughput: HTTP requests/s at concurrency 1, 4, 8 and 16 against a real `omni-studio serve` (default:
tiny-glm-shapes with its shipped deploy config, 128x128), levels alternating over rounds; median req/s per
level, p50/p95 latency, and whether every PNG equals the bytes the same request gave alone.
Target: 8 clients >= 3.0x one client, bytes identical.

    .venv/bin/python bench/throughput.py [--rounds 3] [--per-client 3] [--levels 1 4 8 16]

The machine's speed drifts between rounds; each round's ratio to the same round's 1-client rate (paired,
levels side by side) is printed with its range next to the ratio of the medians.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import kernel_report  # noqa: E402
from engine.stages.row_plan import REFUSE_ENV  # noqa: E402
from tests.servers import running_server  # noqa: E402

PROMPTS = [
    f"a {color} {shape} on a {background} background, {where}"
    for color, shape, background, where in [
        ("red", "circle", "blue", "top left"),
        ("green", "square", "yellow", "bottom right"),
        ("blue", "triangle", "white", "center"),
        ("yellow", "circle", "purple", "top right"),
        ("purple", "square", "green", "bottom left"),
        ("white", "triangle", "red", "center"),
        ("orange", "circle", "blue", "bottom right"),
        ("red", "triangle", "yellow", "top left"),
    ]
]


def request_body(index: int) -> dict:
    return {"messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}], "seed": index}


def png_of(response: httpx.Response) -> bytes:
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine() -> str:
    """The CPU model and the flags that steer the kernels (docs/batching.md, "Which path ran where")."""
    report = kernel_report()
    refused = os.environ.get(REFUSE_ENV)
    return (
        f"{report['cpu']}; {report['cpu_flags']}; ATen {report['aten_capability']}; MKL {report['mkl']}"
        + (f"; {REFUSE_ENV}={refused}" if refused else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-glm-shapes")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; levels alternate within each")
    parser.add_argument("--per-client", type=int, default=3, help="requests per client per level and round")
    parser.add_argument("--serve-args", nargs="*", default=[], help="extra `omni-studio serve` flags")
    args = parser.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="omni-throughput-"))
    with running_server(["serve", "--model", args.model, *args.serve_args], data_dir) as server:
        client = httpx.Client(base_url=server.url, timeout=600)
        # The bytes each request gives alone (also warms the model up).
        alone = {}
        for index in range(len(PROMPTS)):
            response = client.post("/v1/chat/completions", json=request_body(index))
            response.raise_for_status()
            alone[index] = png_of(response)

        rates: dict[int, list[float]] = {level: [] for level in args.levels}
        latencies: dict[int, list[float]] = {level: [] for level in args.levels}
        mismatches = 0
        for round_index in range(args.rounds):
            order = args.levels if round_index % 2 == 0 else list(reversed(args.levels))
            for level in order:
                count = level * args.per_client

                def one(i: int, level: int = level) -> tuple[float, bool]:
                    index = i % len(PROMPTS)
                    started = time.perf_counter()
                    # One bearer token per client: the server's per-client in-flight limit keys on it.
                    headers = {"authorization": f"Bearer throughput-client-{i % level}"}
                    response = client.post("/v1/chat/completions", json=request_body(index), headers=headers)
                    response.raise_for_status()
                    return time.perf_counter() - started, png_of(response) == alone[index]

                started = time.perf_counter()
                with ThreadPoolExecutor(level) as pool:
                    results = list(pool.map(one, range(count)))
                wall = time.perf_counter() - started
                rates[level].append(count / wall)
                latencies[level].extend(seconds for seconds, _ in results)
                mismatches += sum(not same for _, same in results)
                print(
                    f"  round {round_index + 1} concurrency {level:>2}: {count / wall:5.2f} req/s", flush=True
                )
        paths = [
            line.split("{", 1)[1].split("}", 1)[0]
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("omni_studio_decode_path{")
        ]

    base = statistics.median(rates[args.levels[0]])
    print(f"\n{args.model}, {args.rounds} rounds, {args.per_client} requests per client per round")
    print(f"machine: {machine()}")
    print(f"decode path: {'; '.join(paths) or 'not reported'}")
    print(
        f"{'clients':>8} {'req/s median':>13} {'range':>14} {'x vs 1':>7} {'paired x (range)':>18} "
        f"{'p50 s':>7} {'p95 s':>7}"
    )
    for level in args.levels:
        median = statistics.median(rates[level])
        low, high = min(rates[level]), max(rates[level])
        paired = sorted(r / b for r, b in zip(rates[level], rates[args.levels[0]], strict=True))
        paired_text = f"{statistics.median(paired):.2f} ({paired[0]:.2f}-{paired[-1]:.2f})"
        print(
            f"{level:>8} {median:>13.2f} {f'{low:.2f}-{high:.2f}':>14} {median / base:>7.2f} {paired_text:>18} "
            f"{statistics.median(latencies[level]):>7.2f} {percentile(latencies[level], 0.95):>7.2f}"
        )
    print(f"PNG bytes equal to the alone run: {'all' if mismatches == 0 else f'{mismatches} differ'}")
    if 8 in rates:
        ratio = statistics.median(rates[8]) / base
        print(f"target 8 clients >= 3.0x one client: {ratio:.2f}x ({'met' if ratio >= 3.0 else 'not met'})")


if __name__ == "__main__":
    main()
