"""Cold start: process start to UI and API both answering (target <= 10 s with the tiny pipeline).

Starts `omni-studio ui` on 127.0.0.1 a few times (built-in models already cached, as after the first
run on a machine) and prints each time and the median.

    .venv/bin/python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import free_port  # noqa: E402


def ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (
            httpx.get(url + "/", timeout=1).status_code == 200
            and httpx.get(url + "/v1/models", timeout=1).status_code == 200
        )
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny-glm-image")
    parser.add_argument("extra", nargs="*", help="more omni-studio flags, e.g. -- --ar-backend vllm")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp())
    # one unmeasured start builds the model into the cache (a first run on a new machine does this once)
    times = []
    for attempt in range(args.repeats + 1):
        port = free_port()
        started = time.perf_counter()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "studio.cli",
                "ui",
                "--model",
                args.model,
                *args.extra,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ},
        )
        try:
            while not ready(f"http://127.0.0.1:{port}"):
                if process.poll() is not None:
                    raise SystemExit(f"the studio exited with {process.returncode}")
                time.sleep(0.05)
            elapsed = time.perf_counter() - started
        finally:
            process.terminate()
            process.wait(timeout=30)
        if attempt:
            times.append(elapsed)
            print(f"start {attempt}: {elapsed:.2f} s")
        else:
            print(f"warm-up (builds the model cache): {elapsed:.2f} s")
    median = statistics.median(times)
    print(
        f"median cold start {median:.2f} s (target <= 10 s: {'ok' if median <= 10 else 'over'}; "
        f"ratio {median / 10:.2f})"
    )


if __name__ == "__main__":
    main()
