"""Real shapes: the GLM-Image hand-off at the released widths, on CPU, through `omni-studio serve`.

Builds (or reuses) the real-width GLM-Image of tools/real_width (library default widths, each stack cut
to one layer, random weights), starts `omni-studio serve --model <it> --deploy-config <the seed deploy
YAML>` and sends a text-to-image and an image-to-image request at 1024x1024 over HTTP, the way the
seed's client does (stream off, seed 42, generation fields under a literal "extra_body"). Prints the
hand-off counts (AR tokens, prior tokens given to the DiT, prior image ids present or not) beside what
the released model gives at that size, each stage's time and the rates, and the server's peak RSS.

    .venv/bin/python bench/real_shapes.py [--steps 2] [--size 1024] [--seed-deploy YAML] [--model DIR]

The seed deploy YAML is used unchanged; on a machine without a GPU the server gets `--devices cpu` (the
seed places both stages on GPU 0), which moves every stage to the CPU without editing the YAML
(docs/real-shapes.md, "The deploy YAML on CPU").
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.processors import grid_layout, upsample_grid_ids  # noqa: E402
from tests.servers import LiveServer  # noqa: E402
from tests.servers import start_server as start_live_server  # noqa: E402
from tools.real_width.builder import DEFAULT_LAYERS, ensure_built  # noqa: E402
from tools.real_width.handoff_probe import LOG_ENV  # noqa: E402

SEED_DEPLOY = ROOT / "tools" / "real_width" / "seed_deploy.yaml"
SERVED_NAME = "glm-image"
# What the released model hands over at 1024x1024 (the seed report's hand-off table).
SEED_HANDOFF = {
    "t2i": {"ar_tokens": 1281, "prior_tokens": 4096, "prior_image_ids_present": False},
    "i2i": {"ar_tokens": 1025, "prior_tokens": 4096, "prior_image_ids_present": True},
}
T2I_PROMPT = "An impressionist painting of a starry night over a harbour, thick brush strokes."
I2I_PROMPT = "Turn this flat geometric picture into an impressionist painting with thick brush strokes."


def source_image(size: int) -> bytes:
    """A deterministic flat geometric picture (the I2I source), as PNG bytes."""
    image = Image.new("RGB", (size, size), (236, 232, 220))
    draw = ImageDraw.Draw(image)
    step = size // 8
    colours = [(200, 60, 50), (40, 90, 170), (240, 190, 40), (30, 30, 30)]
    for i in range(8):
        for j in range(8):
            if (i * 3 + j) % 5 == 0:
                box = (i * step, j * step, (i + 1) * step - 1, (j + 1) * step - 1)
                draw.rectangle(box, fill=colours[(i + j) % len(colours)])
    draw.ellipse((size // 4, size // 4, 3 * size // 4, 3 * size // 4), outline=(30, 30, 30), width=size // 64)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def chat_payload(content: Any, size: int, steps: int) -> dict[str, Any]:
    """The request the seed's client sends, at ``size`` and ``steps``."""
    return {
        "model": SERVED_NAME,
        "stream": False,
        "seed": 42,
        "messages": [{"role": "user", "content": content}],
        "extra_body": {"height": size, "width": size, "num_inference_steps": steps, "guidance_scale": 1.5},
    }


def vm_kib(pid: int, field: str = "VmHWM") -> int | None:
    """A memory field of the process's ``/proc/<pid>/status`` in KiB (``VmHWM``: its peak resident set
    size; ``VmRSS``: the current one)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def start_server(
    model: str, deploy: Path, data_dir: Path, handoff_log: Path, deadline_s: float, extra: list[str]
) -> LiveServer:
    """``omni-studio serve`` (through the hand-off probe, tools/real_width/handoff_probe.py) on a free
    127.0.0.1 port; returns once ``/health`` answers, raises with the log if it exits first."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = ["serve", "--model", model, "--deploy-config", str(deploy), "--served-model-name", SERVED_NAME]
    env = {LOG_ENV: str(handoff_log), "PYTHONUNBUFFERED": "1"}
    return start_live_server(
        [*args, *extra], data_dir, timeout=deadline_s, module="tools.real_width.handoff_probe", env=env
    )


def gib(kib: int | None) -> str:
    return f"{kib / 2**20:.2f} GiB" if kib else "n/a"


def memory_estimate(model: str, deploy: Path, extra: list[str]) -> int | None:
    """Bytes engine/memory_estimate/ expects on the CPU for this model and deploy YAML (what
    ``validate --check-devices`` prints), with the serve flags' ``--devices``."""
    from engine.building import build_pipeline_config
    from engine.memory_estimate import estimate_memory
    from engine.models import describe_model

    devices = extra[extra.index("--devices") + 1] if "--devices" in extra else None
    config = build_pipeline_config(describe_model(model), deploy, None, devices)
    need = estimate_memory(config, Path(model)).need("cpu")
    return need or None


def stage_records(data_dir: Path) -> list[dict[str, Any]]:
    """Every recorded run with its stages, oldest first (``omni-studio history``, the run store)."""

    def history(*args: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-m", "studio.cli", "history", *args, "--json", "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        return json.loads(out.stdout)

    listed = history("ls")
    runs = listed if isinstance(listed, list) else listed.get("runs", [])
    return [history("show", run["id"]) for run in reversed(runs)]


def png_size(response: httpx.Response) -> tuple[int, int]:
    content = response.json()["choices"][0]["message"]["content"]
    images = [item for item in content if item.get("type") == "image_url"]
    if len(images) != 1:
        raise RuntimeError(f"expected one image in the reply, got {len(images)}")
    url = images[0]["image_url"]["url"]
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1], validate=True)))
    image.load()
    return image.size


def expected_handoff(size: int) -> dict[str, dict[str, Any]]:
    """What ``ar2diffusion`` must hand over at ``size`` (engine/processors.py's layout)."""
    out = {}
    for case, t2i in (("t2i", True), ("i2i", False)):
        layout = grid_layout(size, size, text_to_image=t2i)
        prior = upsample_grid_ids(torch_zeros(layout.target_tokens), layout.target_h, layout.target_w)
        out[case] = {
            "ar_tokens": layout.max_new_tokens,
            "prior_tokens": int(prior.numel()),
            "prior_image_ids_present": not t2i,
        }
    return out


def torch_zeros(n: int) -> Any:
    import torch

    return torch.zeros(n, dtype=torch.long)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GLM-Image folder (default: the real-width build, cached)")
    parser.add_argument("--cache-dir", type=Path, help="where the real-width build is cached")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers per stack of the build")
    parser.add_argument("--seed-deploy", type=Path, default=SEED_DEPLOY, help="the seed's deploy YAML")
    parser.add_argument("--size", type=int, default=1024, help="image height and width (default 1024)")
    parser.add_argument("--steps", type=int, default=2, help="diffusion steps (default 2)")
    parser.add_argument("--cases", nargs="+", default=["t2i", "i2i"], choices=["t2i", "i2i"])
    parser.add_argument("--serve-args", default="", help="extra `serve` flags, one string (smoke runs)")
    parser.add_argument("--start-timeout", type=float, default=1800, help="bounds a hung start only")
    args = parser.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    started = time.perf_counter()
    model = args.model or str(ensure_built(args.cache_dir, layers=args.layers))
    print(f"model: {model} (ready in {time.perf_counter() - started:.0f}s)", flush=True)

    data_dir = Path(tempfile.mkdtemp(prefix="omni-real-shapes-"))
    handoff_log = data_dir / "handoff.jsonl"
    seed_text = args.seed_deploy.read_text()
    deploy = data_dir / "seed-deploy.yaml"
    deploy.write_text(seed_text)  # exactly the seed's YAML
    print(f"deploy: {args.seed_deploy} (copied unchanged to {deploy})", flush=True)

    import torch

    extra = shlex.split(args.serve_args)
    placement = "the YAML's own devices"
    if "--devices" not in extra and not torch.cuda.is_available():
        # The seed places both stages on GPU 0; here they run on the CPU, the YAML unchanged.
        extra += ["--devices", "cpu"]
        placement = "serve --devices cpu (no GPU here; the YAML unchanged)"
    print(f"placement: {placement}", flush=True)
    started = time.perf_counter()
    try:
        server = start_server(model, deploy, data_dir, handoff_log, args.start_timeout, extra)
    except RuntimeError as exc:
        print(f"\nFINDING: the seed deploy YAML does not start here:\n{exc}\n", flush=True)
        return 1
    startup_s = time.perf_counter() - started
    pid = server.process.pid
    ready_rss, ready_peak = vm_kib(pid, "VmRSS"), vm_kib(pid)
    print(
        f"server ready in {startup_s:.1f}s (pid {pid}, RSS {gib(ready_rss)}, peak {gib(ready_peak)})",
        flush=True,
    )

    source = "data:image/png;base64," + base64.b64encode(source_image(args.size)).decode()
    contents = {
        "t2i": T2I_PROMPT,
        "i2i": [{"type": "text", "text": I2I_PROMPT}, {"type": "image_url", "image_url": {"url": source}}],
    }
    walls: dict[str, float] = {}
    peaks: dict[str, tuple[int | None, int | None]] = {}
    try:
        client = httpx.Client(base_url=server.url, timeout=httpx.Timeout(10, read=None), trust_env=False)
        client.get("/health").raise_for_status()
        for case in args.cases:
            t0 = time.perf_counter()
            response = client.post(
                "/v1/chat/completions", json=chat_payload(contents[case], args.size, args.steps)
            )
            walls[case] = time.perf_counter() - t0
            if response.status_code != 200:
                raise RuntimeError(f"{case}: HTTP {response.status_code}: {response.text[:3000]}")
            size = png_size(response)
            if size != (args.size, args.size):
                raise RuntimeError(f"{case}: image is {size}, asked for {args.size}x{args.size}")
            peaks[case] = (vm_kib(pid, "VmRSS"), vm_kib(pid))
            print(f"{case}: HTTP 200, one {size[0]}x{size[1]} PNG in {walls[case]:.1f}s", flush=True)
        runs = stage_records(data_dir)
    finally:
        peak_end = vm_kib(pid)
        server.stop()

    handoffs = (
        [json.loads(line) for line in handoff_log.read_text().splitlines()] if handoff_log.exists() else []
    )
    expected = expected_handoff(args.size)
    print("\n== hand-off (recorded in the server at ar2diffusion) ==")
    header = f"{'case':<5} {'AR tokens':>10} {'prior tokens':>13} {'prior image ids':>16}   expected"
    print(header)
    for case, record in zip(args.cases, handoffs, strict=False):
        want = SEED_HANDOFF[case] if args.size == 1024 else expected[case]
        got = (record["ar_tokens"], record["prior_tokens"], record["prior_image_ids_present"])
        wanted = (want["ar_tokens"], want["prior_tokens"], want["prior_image_ids_present"])
        present = f"present ({record['prior_image_ids']})" if got[2] else "absent"
        source_label = "seed report" if args.size == 1024 else "layout"
        verdict = "MATCH" if got == wanted else "DIFFERS"
        print(f"{case:<5} {got[0]:>10} {got[1]:>13} {present:>16}   {verdict} ({source_label}: {wanted})")

    print("\n== stages (run store records) ==")
    for case, run in zip(args.cases, runs, strict=False):
        for stage in run.get("stages", []):
            seconds = stage.get("seconds") or 0.0
            line = f"{case:<5} stage {stage['stage_id']} {stage['kind']:<9} {seconds:8.1f}s  status={stage['status']}"
            if stage["kind"] == "ar":
                tokens = int(stage.get("output_tokens") or 0)
                rate = tokens / seconds if seconds else 0.0
                line += f"  output_tokens={tokens} ({rate:.2f} tok/s, {1000 * seconds / max(tokens, 1):.0f} ms/tok)"
            else:
                line += (
                    f"  {seconds / args.steps:.1f}s per step incl. glyph encode and VAE (steps={args.steps})"
                )
            print(line)
        print(f"{case:<5} HTTP wall {walls.get(case, 0.0):.1f}s")

    print("\n== memory (server process: VmRSS now, VmHWM peak) ==")
    print(f"ready:       RSS {gib(ready_rss)}, peak {gib(ready_peak)}")
    for case in args.cases:
        rss, peak = peaks.get(case, (None, None))
        print(f"after {case}:   RSS {gib(rss)}, peak {gib(peak)}")
    print(f"at the end:  peak {gib(peak_end)}")
    estimated = memory_estimate(model, deploy, extra)
    if estimated and peak_end:
        print(
            f"estimate before loading (validate --check-devices): {gib(estimated // 1024)} on cpu; measured "
            f"peak / estimate: {peak_end * 1024 / estimated:.2f} (target: within 25%, 0.75-1.25)"
        )
    print(f"\nstartup {startup_s:.1f}s; deploy: the seed YAML unchanged; placement: {placement}")
    ok = len(handoffs) == len(args.cases) and all(
        (r["ar_tokens"], r["prior_tokens"], r["prior_image_ids_present"])
        == tuple((SEED_HANDOFF[c] if args.size == 1024 else expected[c]).values())
        for c, r in zip(args.cases, handoffs, strict=False)
    )
    print("RESULT:", "hand-off counts match" if ok else "hand-off counts DIFFER or are missing")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
