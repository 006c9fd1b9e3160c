"""From a model and a deploy config to a validated :class:`engine.config.PipelineConfig`: the model's
defaults under the deploy file, the AR backend override, and the devices its stages would run on.

Nothing here loads a model: ``omni-studio validate``, the Pipeline tab and jobs check a config with these
before :func:`engine.engine.build_engine` starts anything.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engine.config import (
    ConfigProblem,
    DeployConfig,
    DevicePlacement,
    PipelineConfig,
    StageConfig,
    parse_deploy_config,
    parse_deploy_file,
    parse_deploy_yaml_text,
    resolve_pipeline_config,
)
from engine.config.deploy import DEVICES_PATTERN
from engine.models import ModelSource, model_sampling_defaults


def resolve_device(placement: DevicePlacement) -> torch.device:
    """``auto`` -> GPU 0 if present else CPU; ``cpu``; ``'0'``/``'0,1'`` -> the first listed GPU."""
    if placement.is_auto:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if placement.is_cpu:
        return torch.device("cpu")
    return torch.device(f"cuda:{placement.gpus[0]}")


def device_problems(config: PipelineConfig) -> list[ConfigProblem]:
    """Stages placed on GPUs this machine does not have."""
    problems = []
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for stage in config.stages:
        placement = stage.engine_args.placement
        missing = [d for d in placement.gpus if d >= available]
        if missing:
            have = "no GPU" if available == 0 else f"{available} GPU(s) (0-{available - 1})"
            hint = (
                "devices: cpu (or auto)"
                if available == 0
                else f"devices: '0' .. '{available - 1}', cpu or auto"
            )
            problems.append(
                ConfigProblem(
                    stage.stage_id,
                    "devices",
                    f"devices {placement.spec!r} names GPU {', '.join(map(str, missing))} but this machine has {have}; "
                    f"use {hint}",
                )
            )
    return problems


def build_pipeline_config(
    source: ModelSource,
    deploy: DeployConfig | dict | str | Path | None = None,
    ar_backend: str | None = None,
    devices: str | None = None,
) -> PipelineConfig:
    """Validate ``deploy`` (a model, a parsed YAML document or a path) against ``source``'s family.
    ``ar_backend`` / ``devices`` (``--ar-backend``, ``--devices``): override every stage's.

    A parsed document that is not a mapping (YAML ``true``, a list...) is reported as a config problem.
    """
    label = None
    problems: list[ConfigProblem] = []
    if deploy is None and source.default_deploy_path is not None:
        deploy = source.default_deploy_path
    if isinstance(deploy, (str, Path)):
        label = str(deploy)
        deploy, problems = parse_deploy_file(deploy)
    elif deploy is not None and not isinstance(deploy, DeployConfig):
        deploy, problems = parse_deploy_config(deploy)
    return _resolve_for(source, deploy, problems, label, ar_backend, devices)


def with_model_defaults(source: ModelSource, deploy: DeployConfig | None) -> DeployConfig | None:
    """``deploy`` with the model's own sampling defaults (its card, then its preset:
    :func:`engine.models.model_sampling_defaults`) under every value it leaves out, per stage, so a
    partial deploy config never falls back to a family-wide default the model cannot draw."""
    defaults = model_sampling_defaults(source)
    if not defaults or (deploy is not None and "stages" in deploy.model_fields_set and not deploy.stages):
        return deploy  # an empty stage list is the user's mistake to hear about, not to fill in
    deploy = deploy or DeployConfig()
    kinds = {t.stage_id: t.kind for t in source.family.templates}
    stages = []
    for stage in deploy.stages:
        extra = defaults.get(stage.stage_id)
        own = stage.default_sampling_params
        if (
            extra
            and (own is None or isinstance(own, dict))
            and stage.kind in (None, kinds.get(stage.stage_id))
        ):
            stage = stage.model_copy(update={"default_sampling_params": {**extra, **(own or {})}})
        stages.append(stage)
    listed = {stage.stage_id for stage in deploy.stages}
    stages += [
        StageConfig.model_validate({"stage_id": sid, "default_sampling_params": dict(params)})
        for sid, params in sorted(defaults.items())
        if sid not in listed and sid in kinds
    ]
    return deploy.model_copy(update={"stages": stages})


def _resolve_for(
    source: ModelSource,
    deploy: DeployConfig | None,
    problems: list[ConfigProblem],
    label: str | None,
    ar_backend: str | None,
    devices: str | None = None,
) -> PipelineConfig:
    deploy = with_model_defaults(source, deploy)
    if devices and not DEVICES_PATTERN.match(devices):
        problems = [
            *problems,
            ConfigProblem(
                None,
                "devices",
                f"--devices {devices!r}: use 'auto', 'cpu' or GPU indices such as '0' or '0,1'",
            ),
        ]
    elif devices:
        deploy = with_devices(source, deploy, devices)
    config = resolve_pipeline_config(
        deploy,
        source.family.name,
        source.family.templates,
        source.name,
        source.identity,
        source=label,
        prior_problems=problems,
    )
    if ar_backend:  # --ar-backend overrides every AR stage, `auto` included
        config = with_ar_backend(config, ar_backend)
    return config


def pipeline_config_from_text(
    source: ModelSource, text: str, ar_backend: str | None = None, devices: str | None = None
) -> PipelineConfig:
    """Validate deploy YAML *text* (the Pipeline tab's editor) against ``source``'s family.

    The parsed document is always a document, never a path: YAML text that is a plain string (say
    ``/etc/passwd``) is a config problem, not a file to read.
    """
    data = parse_deploy_yaml_text(text)
    deploy, problems = parse_deploy_config(data if data is not None else {})
    return _resolve_for(source, deploy, problems, None, ar_backend, devices)


def with_devices(source: ModelSource, deploy: DeployConfig | None, devices: str) -> DeployConfig:
    """``--devices``: every stage of the family placed on ``devices`` (checked against
    :data:`DEVICES_PATTERN` by the caller), whatever the document says: a GPU deploy config runs unchanged
    on a CPU with ``--devices cpu``."""
    deploy = deploy or DeployConfig()
    listed = {stage.stage_id for stage in deploy.stages}
    stages = [stage.model_copy(update={"devices": devices}) for stage in deploy.stages]
    stages += [
        StageConfig.model_validate({"stage_id": t.stage_id, "devices": devices})
        for t in source.family.templates
        if t.stage_id not in listed
    ]
    return deploy.model_copy(update={"stages": stages})


def with_ar_backend(config: PipelineConfig, backend: str) -> PipelineConfig:
    """``--ar-backend``: override the backend of every AR stage."""
    stages = tuple(replace(s, backend=backend) if s.kind == "ar" else s for s in config.stages)
    return replace(config, stages=stages)
