"""Where an engine's stage runners run: in this process, in a child process of their own
(``own_process``), or as Ray actors on a cluster (``--ray-address``; docs/distributed.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engine.building import resolve_device
from engine.config import PipelineConfig, ResolvedStage
from engine.models import ModelSource
from engine.paths import default_data_dir, model_cache_dir
from engine.stages.base import StageRunner

log = logging.getLogger("omni_studio.engine")


class RunnerPlacementError(RuntimeError):
    """The runners cannot be placed where asked (Ray is not installed)."""


def runner_factory(
    config: PipelineConfig, model: ModelSource, ray_address: str | None, model_cache: Path | None
) -> Callable[[ResolvedStage], StageRunner]:
    """How this engine makes its stage runners: in this process, or as Ray actors (docs/distributed.md)."""
    path = model.path
    assert path is not None
    if not ray_address:
        placed = [s.stage_id for s in config.stages if s.engine_args.num_replicas or s.engine_args.resources]
        if placed:
            log.warning(
                "stage(s) %s set num_replicas/resources, which apply on a Ray cluster (--ray-address); "
                "embedded mode runs one copy of each stage",
                ", ".join(map(str, placed)),
            )

        def create(stage: ResolvedStage) -> StageRunner:
            device = resolve_device(stage.engine_args.placement)
            if stage.engine_args.own_process:
                from engine.distributed.process_stage import ProcessStageRunner

                return ProcessStageRunner(stage, model, device)
            return model.family.create_runner(stage, path, device)

        return create
    try:
        # Ray is an optional extra: imported only when a Ray address is given.
        from engine.distributed.ray_stage import RayPlacement
    except ImportError as exc:
        raise RunnerPlacementError(
            f"--ray-address needs Ray: pip install 'omni-studio[ray]' ({exc})"
        ) from exc
    placement = RayPlacement(ray_address, config.ray, model_cache or model_cache_dir(default_data_dir()))
    return lambda stage: placement.runner(stage, model)
