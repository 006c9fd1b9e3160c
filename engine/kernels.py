"""What the CPU kernels of this process run on: the machine properties a picture's bytes depend on.

A picture's bytes are the end of millions of float operations, and the libraries pick their code by CPU:
MKL's sgemm has other kernels on Intel's AVX-512 path than on its AVX2 path (and on AMD CPUs), oneDNN
generates its convolutions (the VAE's, the DiT's) for the widest vectors the CPU has, ATen's vectorized
loops (norms, softmax) sum in lanes of the vector width. docs/recipes.md ("Same picture on another
machine") says which of these changed the pinned pictures when measured and which did not; the System tab
shows this report so two colleagues can compare their machines.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path


@cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo, read once (empty where it cannot be read)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpuinfo(*keys: str) -> str:
    """The first /proc/cpuinfo value whose name starts with one of ``keys`` ("" where unknown)."""
    for line in _cpuinfo_lines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty where it cannot be read)."""
    return frozenset(_cpuinfo("flags", "Features").split())


def vector_class(flags: frozenset[str] | None = None) -> str:
    """The CPU's widest vectors as oneDNN picks its kernels by them: ``avx512`` (AVX-512 with BW/VL/DQ,
    AMX machines included: AMX serves bf16/int8, not float32), ``avx2``, or the architecture's name."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown"
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "x86-64"


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def kernel_report() -> dict[str, str]:
    """The CPU and the code paths the libraries take on it (torch must be importable)."""
    import torch

    flags, vendor = cpu_flags(), cpu_vendor()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return {
        "cpu": cpu_model(),
        "vector_class": vector_class(flags),
        "cpu_flags": " ".join(shown) or "none of avx2, avx512f, amx",
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": "Intel CPU path" if vendor == "GenuineIntel" else f"{vendor or 'non-Intel'} CPU path",
        "torch": torch.__version__,
    }


def cpu_vendor() -> str:
    """The CPU vendor (GenuineIntel, AuthenticAMD; empty where unknown): MKL takes other code on each."""
    return _cpuinfo("vendor_id")
