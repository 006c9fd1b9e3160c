"""API overhead: median HTTP latency minus direct engine latency for the same tiny request (target <= 15 ms),
and throughput at concurrency 1, 4 and 16.

Starts a real `omni-studio serve` on 127.0.0.1 (tiny-glm-image, 64x64, 4 steps) and, for the direct
figure, an engine in this process with the same model and deploy config.

    .venv/bin/python bench/api_overhead.py [--repeats 15] [--rounds 3] [--per-worker 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import start_server  # noqa: E402

PAYLOAD = {
    "messages": [{"role": "user", "content": "a red 'cat'"}],
    "seed": 1,
    "extra_body": {"height": 64, "width": 64, "num_inference_steps": 4},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--per-worker", type=int, default=2, help="requests per concurrent client per round")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (levels alternate; median)")
    args = parser.parse_args()

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.environment import quiet_libraries
    from studio.startup.launch import tune_interpreter

    quiet_libraries()
    tune_interpreter()  # as in the server process, so both sides run alike
    data_dir = Path(tempfile.mkdtemp())
    deploy = {"stages": [{"stage_id": 0, "backend": "transformers"}, {"stage_id": 1}]}
    import yaml

    deploy_path = data_dir / "deploy.yaml"
    base = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "assets/deploy/tiny-glm-image.yaml").read_text()
    )
    base["stages"][0]["backend"] = deploy["stages"][0]["backend"]
    deploy_path.write_text(yaml.safe_dump(base))

    engine = build_engine("tiny-glm-image", deploy_path, data_dir=data_dir)
    request = GenerationRequest(
        "a red 'cat'", GenerationParams(seed=1, height=64, width=64, num_inference_steps=4)
    )
    server = start_server(["serve", "--deploy-config", str(deploy_path)], data_dir / "server")
    try:
        client = httpx.Client(base_url=server.url, timeout=300)
        engine.run(request)
        client.post("/v1/chat/completions", json=PAYLOAD).raise_for_status()
        direct, http = [], []
        for _ in range(args.repeats):  # interleaved, so load from elsewhere hits both alike
            t = time.perf_counter()
            engine.run(request)
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.post("/v1/chat/completions", json=PAYLOAD).raise_for_status()
            http.append(time.perf_counter() - t)
        engine.close()
        d, h = statistics.median(direct) * 1000, statistics.median(http) * 1000
        # Paired differences (each HTTP call against the direct call just before it) cancel most of the
        # drift from other work on the machine; their median is the overhead estimate.
        paired = statistics.median(b - a for a, b in zip(direct, http, strict=True)) * 1000
        print(f"direct engine  median {d:8.1f} ms")
        print(f"HTTP           median {h:8.1f} ms")
        print(
            f"overhead       median of paired differences {paired:8.1f} ms "
            f"(target <= 15 ms: {'ok' if paired <= 15 else 'over'}; ratio {paired / 15:.2f})"
        )
        print()
        # The levels alternate round by round, so a slow phase of the machine hits every level alike.
        levels = (1, 4, 16)
        rates: dict[int, list[float]] = {level: [] for level in levels}
        for _ in range(args.rounds):
            for concurrency in levels:

                def worker(_: int) -> None:
                    with httpx.Client(base_url=server.url, timeout=600) as c:
                        for _ in range(args.per_worker):
                            c.post("/v1/chat/completions", json=PAYLOAD).raise_for_status()

                t = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(worker, range(concurrency)))
                rates[concurrency].append(concurrency * args.per_worker / (time.perf_counter() - t))
        print(
            f"{'concurrency':>11} {'requests':>9} {'req/s (median of ' + str(args.rounds) + ' rounds)':>28}  rounds"
        )
        for level in levels:
            each = " ".join(f"{r:.2f}" for r in rates[level])
            print(
                f"{level:>11} {level * args.per_worker:>9} {statistics.median(rates[level]):>28.2f}  {each}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
