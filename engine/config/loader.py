"""Reading deploy YAML into :class:`DeployConfig`, collecting every problem instead of stopping at the first."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from engine.config.deploy import DeployConfig, StageConfig
from engine.config.errors import ConfigProblem, DeployConfigError


def _model_at(model: type[BaseModel], loc: list[str]) -> type[BaseModel]:
    """The nested model a location points into (``ray.adress`` -> the ``ray:`` section's model)."""
    for part in loc:
        info = model.model_fields.get(part)
        if info is None:
            break
        nested = [
            t
            for t in (info.annotation, *getattr(info.annotation, "__args__", ()))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if not nested:
            break
        model = nested[0]
    return model


def _describe_error(error: ErrorDetails, model: type[BaseModel]) -> tuple[str, str]:
    """(dotted key, message) for one pydantic error, with allowed keys named for unknown ones."""
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_model_at(model, loc[:-1]).model_fields))
        return key, f"unknown key {loc[-1]!r}; allowed keys: {allowed}"
    if error["type"] == "missing":
        return key, "required key is missing"
    if error["type"] == "string_pattern_mismatch" and loc and loc[-1] == "devices":
        return (
            key,
            f"invalid devices {error['input']!r}; use 'auto', 'cpu' or GPU indices such as '0' or '0,1'",
        )
    message = error["msg"]
    if "input" in error and error["type"] not in ("missing",):
        message += f" (got {error['input']!r})"
    return key, message


def problems_from_validation_error(
    exc: ValidationError, model: type[BaseModel], stage: int | str | None, prefix: str = ""
) -> list[ConfigProblem]:
    problems = []
    for error in exc.errors():
        key, message = _describe_error(error, model)
        problems.append(ConfigProblem(stage, f"{prefix}{key}", message))
    return problems


def read_deploy_yaml(source: str | Path) -> Any:
    """Load YAML from a path; syntax errors become a :class:`DeployConfigError`."""
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeployConfigError([ConfigProblem(None, "", f"cannot read {path}: {exc.strerror}")]) from exc
    return parse_deploy_yaml_text(text, source=str(path))


def parse_deploy_yaml_text(text: str, source: str | None = None) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeployConfigError([ConfigProblem(None, "", f"not valid YAML: {exc}")], source=source) from exc


def _stage_label(raw: Any, index: int) -> int | str:
    if (
        isinstance(raw, dict)
        and isinstance(raw.get("stage_id"), int)
        and not isinstance(raw["stage_id"], bool)
    ):
        return raw["stage_id"]
    return f"#{index}"


def parse_deploy_config(data: Any, source: str | None = None) -> tuple[DeployConfig, list[ConfigProblem]]:
    """Validate a parsed deploy document, keeping what is valid so later checks can still run.

    A stage with bad keys is kept without those keys (when its ``stage_id`` is usable), so the sampling
    and topology checks that follow report their problems in the same pass.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return DeployConfig(), [
            ConfigProblem(None, "", f"the deploy config must be a mapping, got {type(data).__name__}")
        ]
    problems: list[ConfigProblem] = []
    top = {k: v for k, v in data.items() if k != "stages"}
    try:
        top_model = DeployConfig.model_validate(top)
    except ValidationError as exc:
        problems += problems_from_validation_error(exc, DeployConfig, None)
        top_model = DeployConfig()

    stages_given = "stages" in data
    raw_stages = data.get("stages")
    stages: list[StageConfig] = []
    if raw_stages is None:
        raw_stages = []
    if not isinstance(raw_stages, list):
        problems.append(
            ConfigProblem(None, "stages", f"must be a list of stages, got {type(raw_stages).__name__}")
        )
        raw_stages = []
    for index, raw in enumerate(raw_stages):
        label = _stage_label(raw, index)
        if not isinstance(raw, dict):
            problems.append(ConfigProblem(label, "", f"a stage must be a mapping, got {type(raw).__name__}"))
            continue
        try:
            stages.append(StageConfig.model_validate(raw))
        except ValidationError as exc:
            problems += problems_from_validation_error(exc, StageConfig, label)
            bad_keys = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
            if "stage_id" in bad_keys:
                continue
            with contextlib.suppress(ValidationError):
                stages.append(StageConfig.model_validate({k: v for k, v in raw.items() if k not in bad_keys}))
    fields: dict[str, Any] = {key: getattr(top_model, key) for key in ("async_chunk", "ray") if key in data}
    if stages_given:
        fields["stages"] = stages
    # model_construct keeps model_fields_set honest: an absent `stages` key means "use the topology".
    return DeployConfig.model_construct(_fields_set=set(fields), **fields), problems


def load_deploy_config(data: Any, source: str | None = None) -> DeployConfig:
    """Validate a parsed deploy document; raises :class:`DeployConfigError` with every key-level problem."""
    deploy, problems = parse_deploy_config(data, source)
    if problems:
        raise DeployConfigError(problems, source)
    return deploy


def load_deploy_file(path: str | Path) -> DeployConfig:
    return load_deploy_config(read_deploy_yaml(path), source=str(path))


def parse_deploy_file(path: str | Path) -> tuple[DeployConfig, list[ConfigProblem]]:
    return parse_deploy_config(read_deploy_yaml(path), source=str(path))
