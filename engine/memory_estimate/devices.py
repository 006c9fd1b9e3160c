"""What each device has free for the stages: the CPU's available memory, each GPU's free memory
(docs/memory.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceBudget:
    """What a device has for the stages: ``free`` bytes now, of ``total``."""

    free: int
    total: int


def machine_ram() -> DeviceBudget:
    """The CPU's budget: MemAvailable of /proc/meminfo (Linux), else psutil's when it is installed."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        info = {}
    if "MemAvailable" in info:
        return DeviceBudget(info["MemAvailable"], info.get("MemTotal", info["MemAvailable"]))
    memory = importlib.import_module("psutil").virtual_memory()  # ImportError: no way to tell
    return DeviceBudget(int(memory.available), int(memory.total))


def device_budget(device: str) -> DeviceBudget | None:
    """``device``'s budget on this machine (None: it does not have that device)."""
    if device == "cpu":
        return machine_ram()
    index = int(device.split(":")[1])
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    free, total = torch.cuda.mem_get_info(index)
    return DeviceBudget(int(free), int(total))
