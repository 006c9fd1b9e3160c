"""Deploy configs: models, loading with per-stage errors, and resolution into a :class:`PipelineConfig`."""

from engine.config.deploy import (
    ARSamplingParams,
    DeployConfig,
    DiffusionSamplingParams,
    StageConfig,
)
from engine.config.errors import ConfigProblem, DeployConfigError
from engine.config.loader import (
    load_deploy_config,
    load_deploy_file,
    parse_deploy_config,
    parse_deploy_file,
    parse_deploy_yaml_text,
    read_deploy_yaml,
)
from engine.config.pipeline import (
    DevicePlacement,
    PipelineConfig,
    ResolvedStage,
    StageEngineArgs,
    StageTemplate,
    resolve_pipeline_config,
)

__all__ = [
    "ARSamplingParams",
    "ConfigProblem",
    "DeployConfig",
    "DeployConfigError",
    "DevicePlacement",
    "DiffusionSamplingParams",
    "PipelineConfig",
    "ResolvedStage",
    "StageConfig",
    "StageEngineArgs",
    "StageTemplate",
    "load_deploy_config",
    "load_deploy_file",
    "parse_deploy_config",
    "parse_deploy_file",
    "parse_deploy_yaml_text",
    "read_deploy_yaml",
    "resolve_pipeline_config",
]
