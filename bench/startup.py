"""Cold start, measured against the imports each mode needs: process start to the loading page, the
studio's own page, generate-ready and /health 200.

For `omni-studio ui` and `omni-studio serve` on 127.0.0.1 (built-in model already cached, as after the
first run on a machine), each repeat times:

- placeholder: the first 200 on `/` with the loading page (ui) or the first answer of any status on
  `/health` (serve): the port is held and clients are told to wait;
- page-ready (ui only): `/` serves the studio's own page, i.e. the Gradio config inlined in the HTML lists
  the studio's tabs (studio/ui/app.py), not the loading page (studio/startup/starting.py);
- generate-ready: the first successful chat completion (tried ten times a second, every 503 or refused
  connection retried: in `ui` mode the API serves before Gradio is even imported);
- /health 200: the whole studio is up (for `ui`, the Gradio page too);

and beside them two import floors, each a bare interpreter importing what that mode needs: `serve`
imports torch, transformers and diffusers (never Gradio); `ui` imports those plus gradio (its API serves
before Gradio is imported, so its generate-ready is also set against the serve floor). Repeats alternate
(floors, ui, serve, then the next repeat in a rotated order) so drifting machine load hits every column
alike. Prints each time, then medians and ranges, the ratios of the medians and, steadier where the load
drifts, each start's ratio to the floor of its own repeat. Targets: placeholder <= 3 s; generate-ready
<= 1.3x the serve floor in both modes; ui page-ready <= 1.3x the ui floor.

    .venv/bin/python bench/startup.py [--repeats 5] [--modes ui serve] [--model tiny-glm-image]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import free_port  # noqa: E402

FLOORS = {
    "serve": "import torch, transformers, diffusers",
    "ui": "import torch, transformers, diffusers, gradio",
}
# The studio's tabs (studio/ui/app.py, build_ui): page-ready is when the page served on `/` lists them all.
STUDIO_TABS = {"Chat", "Pipeline", "Serving", "History", "System", "Batch", "Queue"}
LOADING_MARK = 'id="omni-loading"'  # the loading page's paragraph (studio/startup/starting.py, LOADING_PAGE)
GRADIO_CONFIG = re.compile(r"window\.gradio_config\s*=\s*(\{.*?\});\s*</script>", re.S)
POLL_S = 0.02  # placeholder: a GET answered by the loading server
# Afterwards every try lands on the loading server too (a POST it refuses with 503 and records as a refused
# run, or a GET of the loading page): 50 tries a second made the start it measures 1-1.7 s (10-15%)
# slower here, so ten a second (a client honouring Retry-After sends one).
SLOW_POLL_S = 0.1


def status(url: str) -> int | None:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code
    return None


def tab_labels(html: str) -> set[str] | None:
    """The tab labels in the Gradio config inlined in a page, or None for a page without one."""
    match = GRADIO_CONFIG.search(html)
    if match is None:
        return None
    config = json.loads(match.group(1))
    return {
        str(component.get("props", {}).get("label"))
        for component in config.get("components", [])
        if component.get("type") in ("tab", "tabitem")
    }


def import_floor(mode: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOORS[mode]], check=True)
    return time.perf_counter() - started


def watch_page(base: str, started: float, times: dict[str, float], stop: threading.Event) -> None:
    """ui: the loading page's first 200, then the studio's own page (polled less often meanwhile)."""
    while not stop.is_set() and "page" not in times:
        html = None
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(base + "/", timeout=5)
            if response.status_code == 200:
                html = response.text
        now = time.perf_counter() - started
        if html is not None and LOADING_MARK in html:
            times.setdefault("placeholder", now)
        elif html is not None:
            labels = tab_labels(html)
            if labels is None or not STUDIO_TABS.issubset(labels):
                print(f"`/` served neither the loading page nor the studio (tabs {labels}):\n{html[:500]}")
                return
            times.setdefault("placeholder", now)  # (a loading page too short to be seen)
            times["page"] = now
        stop.wait(SLOW_POLL_S if "placeholder" in times else POLL_S)


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
    stop = threading.Event()
    watcher = None
    try:
        if mode == "ui":
            watcher = threading.Thread(target=watch_page, args=(base, started, times, stop), daemon=True)
            watcher.start()
        else:
            while "placeholder" not in times:
                if process.poll() is not None:
                    raise SystemExit(f"omni-studio {mode} exited with {process.returncode}")
                if status(base + "/health") is not None:
                    times["placeholder"] = time.perf_counter() - started
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
            time.sleep(SLOW_POLL_S)
        while "api" not in times:  # /health 200: the whole studio (UI page too) is up
            if process.poll() is not None:
                raise SystemExit(f"omni-studio {mode} exited with {process.returncode}")
            if status(base + "/health") == 200:
                times["api"] = time.perf_counter() - started
            time.sleep(SLOW_POLL_S)
        if watcher is not None:
            watcher.join(timeout=120)
            if "page" not in times:
                raise SystemExit(f"omni-studio {mode}: `/` never served the studio's page")
    finally:
        stop.set()
        process.terminate()
        process.wait(timeout=30)
    return {key: times[key] for key in ("placeholder", "page", "generate", "api") if key in times}


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
    print(f"warm-up (builds the model cache): generate-ready {warm['generate']:.2f} s", flush=True)
    # the serve floor is the yardstick for generate-ready in both modes; the ui floor for the ui page
    floors = ["floor-serve", *(["floor-ui"] if "ui" in args.modes else [])]
    for kind in floors:
        import_floor(kind.removeprefix("floor-"))  # and warms the file cache for the floors alike
    kinds = [*floors, *args.modes]
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        order = kinds[repeat % len(kinds) :] + kinds[: repeat % len(kinds)]
        for kind in order:
            if kind.startswith("floor-"):
                times = {"floor": import_floor(kind.removeprefix("floor-"))}
            else:
                times = start(kind, args.model, data_dir, args.extra)
            results[kind].append(times)
            line = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
            print(f"repeat {repeat + 1} {kind:11}: {line}", flush=True)
    floor = {kind: statistics.median(t["floor"] for t in results[kind]) for kind in floors}
    print()
    for kind in floors:
        mode = kind.removeprefix("floor-")
        print(f"{kind} ({FLOORS[mode]}): {summary([t['floor'] for t in results[kind]])}")
    labels = {
        "placeholder": "placeholder",
        "page": "page-ready",
        "generate": "generate-ready",
        "api": "/health 200",
    }
    for mode in args.modes:
        runs = results[mode]
        print(f"omni-studio {mode}:")
        for key, label in labels.items():
            values = [t[key] for t in runs if key in t]
            if not values:
                continue
            median = statistics.median(values)
            ratios = f"{median / floor['floor-serve']:.2f}x floor-serve"
            if mode == "ui":
                ratios += f", {median / floor['floor-ui']:.2f}x floor-ui"
            print(f"  {label:15} {summary(values)}  = {ratios}")
            # each start against the floors of its own repeat: steadier where the machine's load drifts
            for kind in ("floor-serve", "floor-ui") if mode == "ui" else ("floor-serve",):
                paired = [t[key] / f["floor"] for t, f in zip(runs, results[kind], strict=True) if key in t]
                print(f"  {'':15} paired with {kind}: {summary(paired).replace(' s', 'x')}")
        placeholder = statistics.median(t["placeholder"] for t in runs)
        generate = statistics.median(t["generate"] for t in runs) / floor["floor-serve"]
        verdicts = [
            f"placeholder <= 3 s: {'ok' if placeholder <= 3 else 'over'}",
            f"generate-ready <= 1.3x floor-serve: {'ok' if generate <= 1.3 else 'over'}",
        ]
        if mode == "ui":
            page = statistics.median(t["page"] for t in runs) / floor["floor-ui"]
            verdicts.append(f"page-ready <= 1.3x floor-ui: {'ok' if page <= 1.3 else 'over'}")
        print("  targets: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
