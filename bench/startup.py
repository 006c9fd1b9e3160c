"""Cold start, measured against the import floor: process start to page-ready, generate-ready and /health 200.

For `omni-studio ui` and `omni-studio serve` on 127.0.0.1 (built-in model already cached, as after the
first run on a machine), each repeat times:

- page-ready: the first 200 on `/` (ui) or the first answer of any status on `/health` (serve);
- generate-ready: the first successful chat completion (sent from page-ready on, every 503 or refused
  connection retried ten times a second: in `ui` mode the API serves before `/health` turns 200, while
  the page builds);
- /health 200: the whole studio is up (for `ui`, the Gradio page too);

and beside them the import floor: a process that only imports torch, transformers, diffusers and gradio.
Repeats alternate (floor, ui, serve, then the next repeat in a rotated order) so drifting machine load
hits every column alike. Prints each time, then medians and ranges and the ratio to the floor (target:
page-ready <= 3 s, generate-ready <= 1.3x the floor).

    .venv/bin/python bench/startup.py [--repeats 5] [--modes ui serve] [--model tiny-glm-image]
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

FLOOR = "import torch, transformers, diffusers, gradio"
POLL_S = 0.02  # page-ready: a GET answered by the loading page
# generate-ready: each try is a POST that the loading studio answers (503) and records as a refused run;
# 50 tries a second made the start it measures 1-1.7 s (10-15%) slower here, so ten a second
# (a client honouring Retry-After sends one).
GENERATE_POLL_S = 0.1


def status(url: str) -> int | None:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code
    return None


def import_floor() -> dict[str, float]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], check=True)
    return {"floor": time.perf_counter() - started}


def start(mode: str, model: str, data_dir: Path, extra: list[str]) -> dict[str, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "studio.cli", mode, "--model", model, *extra]
    command += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ}
    )
    times: dict[str, float] = {}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "a red circle on a blue background"}],
        "seed": 1,
    }
    if "chat" not in model:
        body.update(height=64, width=64, num_inference_steps=4)
    try:
        while "page" not in times:
            if process.poll() is not None:
                raise SystemExit(f"omni-studio {mode} exited with {process.returncode}")
            code = status(base + "/") if mode == "ui" else status(base + "/health")
            if (code == 200) if mode == "ui" else (code is not None):
                times["page"] = time.perf_counter() - started
            time.sleep(POLL_S)
        while "generate" not in times:
            if process.poll() is not None:
                raise SystemExit(f"omni-studio {mode} exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):  # the UI hands its port to Gradio
                response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
                if response.status_code == 200:
                    times["generate"] = time.perf_counter() - started
                elif response.status_code != 503:
                    raise SystemExit(f"chat completion: {response.status_code} {response.text[:300]}")
            time.sleep(GENERATE_POLL_S)
        while "api" not in times:  # /health 200: the whole studio (UI page too) is up
            if status(base + "/health") == 200:
                times["api"] = time.perf_counter() - started
            time.sleep(GENERATE_POLL_S)
    finally:
        process.terminate()
        process.wait(timeout=30)
    return times


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=("ui", "serve"), default=["ui", "serve"])
    parser.add_argument("--model", default="tiny-glm-image")
    parser.add_argument("extra", nargs="*", help="more omni-studio flags, e.g. -- --ar-backend vllm")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp())
    # one unmeasured start builds the model into the cache (a first run on a new machine does this once)
    warm = start(args.modes[0], args.model, data_dir, args.extra)
    print(f"warm-up (builds the model cache): generate-ready {warm['generate']:.2f} s")
    import_floor()  # and warms the file cache for the floor alike
    kinds = ["floor", *args.modes]
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        order = kinds[repeat % len(kinds) :] + kinds[: repeat % len(kinds)]
        for kind in order:
            times = import_floor() if kind == "floor" else start(kind, args.model, data_dir, args.extra)
            results[kind].append(times)
            print(f"repeat {repeat + 1} {kind:5}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
    floor = statistics.median(t["floor"] for t in results["floor"])
    print(f"\nimport floor ({FLOOR}): {summary([t['floor'] for t in results['floor']])}")
    for mode in args.modes:
        runs = results[mode]
        print(f"omni-studio {mode}:")
        for key, label in (("page", "page-ready"), ("generate", "generate-ready"), ("api", "/health 200")):
            values = [t[key] for t in runs]
            print(f"  {label:15} {summary(values)}  = {statistics.median(values) / floor:.2f}x floor")
        page = statistics.median(t["page"] for t in runs)
        ratio = statistics.median(t["generate"] for t in runs) / floor
        print(
            f"  targets: page-ready <= 3 s: {'ok' if page <= 3 else 'over'}; "
            f"generate-ready <= 1.3x floor: {'ok' if ratio <= 1.3 else 'over'}"
        )


if __name__ == "__main__":
    main()
