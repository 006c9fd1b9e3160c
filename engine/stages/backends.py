"""Choosing an AR stage's backend: ``auto`` | ``vllm`` | ``transformers`` (SPEC section 8)."""

from __future__ import annotations

import importlib.util

from engine.config import ResolvedStage
from engine.stages.base import StageRunner

AR_BACKENDS = ("auto", "vllm", "transformers")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this stage here."""


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


_import_error: ImportError | None = None  # why vLLM is installed but unusable, if it is


def vllm_runner_for(family: str) -> type[StageRunner] | None:
    """The vLLM runner for ``family``'s AR stage, if vLLM is installed and we have one for it."""
    global _import_error
    if not vllm_importable():
        return None
    try:
        from engine.stages import ar_vllm  # noqa: F401  (present once the vLLM backend lands)
    except ImportError as exc:
        _import_error = exc
        return None
    return ar_vllm.RUNNERS.get(family)


def ar_runner_class(
    stage: ResolvedStage, transformers_runner: type[StageRunner], family: str
) -> type[StageRunner]:
    backend = stage.backend or "auto"
    if backend == "transformers":
        return transformers_runner
    runner = vllm_runner_for(family)
    if runner is not None:
        return runner
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
    return transformers_runner
