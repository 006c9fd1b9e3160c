"""Choosing an AR stage's backend: ``auto`` | ``vllm`` | ``transformers`` (docs/vllm.md).

This module decides *which* backend runs a stage; each model family owns its runners and imports its
vLLM runner only when this says ``vllm`` (importing vLLM takes seconds).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from engine.config import ResolvedStage

AR_BACKENDS = ("auto", "vllm", "transformers")
ChosenBackend = Literal["vllm", "transformers"]


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this stage here."""


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


_import_error: ImportError | None = None  # why vLLM is installed but unusable, if it is


def vllm_usable() -> bool:
    """Whether vLLM is installed and our generic vLLM stage machinery imports (it imports vLLM)."""
    global _import_error
    if not vllm_importable():
        return False
    try:
        from engine.stages import ar_vllm  # noqa: F401
    except ImportError as exc:
        _import_error = exc
        return False
    return True


def select_ar_backend(stage: ResolvedStage, family: str, has_vllm_runner: bool = True) -> ChosenBackend:
    """The backend ``stage`` runs on: its ``backend`` key, with ``auto`` taking vLLM when it is usable.

    Raises :class:`BackendUnavailable` when ``vllm`` is asked for but vLLM is missing or broken here, or
    ``family`` has no vLLM runner.
    """
    backend = stage.backend or "auto"
    if backend == "transformers":
        return "transformers"
    if vllm_usable() and has_vllm_runner:
        return "vllm"
    if backend == "vllm":
        if not vllm_importable():
            reason = "vLLM is not installed"
        elif _import_error is not None:
            reason = str(_import_error)
        else:
            reason = f"there is no vLLM runner for {family} yet"
        raise BackendUnavailable(
            f"stage {stage.stage_id}: backend 'vllm' requested but {reason}; use backend: transformers or auto"
        )
    return "transformers"
