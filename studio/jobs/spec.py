"""What a batch job asks for: prompts x seeds x up to two parameter axes (X and Y), and the cells it makes.

One model serves the three ways in (docs/jobs.md): the YAML file of ``omni-studio batch JOB.yaml``, the
JSON body of ``POST /v1/studio/jobs`` and the Batch tab's form. :func:`parse_job_spec` checks a document
and reports *every* problem at once, each with its field path (``x.values[1]``) and what is allowed there;
the running studio adds what only it knows (which models it can load, what each cell resolves to) in
``studio/jobs/service.py``. Nothing here imports the engine's heavy modules: a bad job file is refused before torch
loads.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.paths import DEPLOY_PRESETS_DIR
from engine.tempo import MAX_SPEED, MIN_SPEED
from studio.startup.limits import InputLimits

AxisParam = Literal["steps", "guidance", "size", "negative_prompt", "model", "deploy", "voice", "speed"]
AXIS_PARAMS: tuple[str, ...] = get_args(AxisParam)
AXIS_NAMES = ("x", "y")
MAX_PROMPTS = 32
MAX_SEEDS = 16
MAX_AXIS_VALUES = 16
MAX_CELLS = 256
MAX_SEED = 2**63 - 1
SIZE_PATTERN = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MIN_SIDE = 16


def deploy_presets() -> list[str]:
    """The deploy presets a job may name (``assets/deploy/<name>.yaml``)."""
    return sorted(path.stem for path in DEPLOY_PRESETS_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a job: the field path (``x.values[1]``, ``prompts[0]``) and what to change."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class JobSpecError(ValueError):
    """A job that cannot run; ``problems`` lists every issue found, each naming its field."""

    def __init__(self, problems: Sequence[SpecProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self.render())

    @property
    def field(self) -> str:
        return self.problems[0].field if self.problems else ""

    def render(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return f"{head}{self.problems[0]}"
        lines = [f"{head}{len(self.problems)} problems in the job:"]
        lines += [f"  - {problem}" for problem in self.problems]
        return "\n".join(lines)

    def summary(self) -> str:
        """The problems on one line (an API error message)."""
        return "; ".join(str(problem) for problem in self.problems)


class JobAxis(BaseModel):
    """One grid axis: the parameter it varies and its values (one grid column or row per value)."""

    model_config = ConfigDict(extra="forbid")

    param: AxisParam = Field(description="the parameter this axis varies")
    values: list[Any] = Field(
        min_length=1,
        max_length=MAX_AXIS_VALUES,
        description="steps: whole numbers; guidance: numbers; size: 'WIDTHxHEIGHT'; negative_prompt: text; "
        "model: a built-in model or the served one; deploy: a preset name (assets/deploy) or a deploy "
        "config mapping; voice: the model's voices (speech); speed: numbers from 0.25 to 4.0 (speech)",
    )


SPEC_EXAMPLE: dict[str, Any] = {
    "name": "guidance vs steps",
    "prompts": ["a red circle on a blue background, center"],
    "seeds": [7],
    "size": "64x64",
    "x": {"param": "guidance", "values": [1.0, 3.0]},
    "y": {"param": "steps", "values": [2, 4]},
}


class JobSpec(BaseModel):
    """A batch job (``POST /v1/studio/jobs``, ``omni-studio batch JOB.yaml``): every prompt with every seed
    at every X and Y value is one cell, run and recorded like any request; the cells form a labelled grid."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [SPEC_EXAMPLE]})

    name: str | None = Field(None, max_length=200, description="shown in the queue and the grid's title")
    prompts: list[str] = Field(min_length=1, max_length=MAX_PROMPTS, description="one prompt or several")
    seeds: list[int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SEEDS,
        description="one seed or several (default: one random seed, fixed when the job is submitted)",
    )
    x: JobAxis | None = Field(None, description="the grid's columns")
    y: JobAxis | None = Field(None, description="the grid's rows")
    model: str | None = Field(None, description="model of every cell (default: the served model)")
    deploy: str | dict[str, Any] | None = Field(
        None, description="deploy preset name or deploy config mapping (default: the served config)"
    )
    steps: int | None = Field(None, ge=1, description="num_inference_steps (default: the model's)")
    guidance: float | None = Field(None, ge=0.0, le=100.0, description="guidance_scale")
    size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 128x128 (default: the model's)")
    negative_prompt: str | None = None
    # Speech (a model that speaks, e.g. tiny-qwen-omni; docs/speech.md): each cell is a spoken run.
    voice: str | None = Field(None, description="the speaker (default: the model's first voice)")
    speed: float | None = Field(None, description="tempo with the pitch kept, 0.25 to 4.0 (1.0: as spoken)")
    say: bool = Field(
        False,
        description="true: each prompt is the words to say (as /v1/audio/speech's input), audio only; "
        "false: the model answers each prompt",
    )

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("seeds", mode="before")
    @classmethod
    def _one_seed(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    # -- the cells ---------------------------------------------------------------------------------

    def axes(self) -> dict[str, JobAxis]:
        """The axes given, by name (``x``, ``y``)."""
        return {name: axis for name in AXIS_NAMES if (axis := getattr(self, name)) is not None}

    def cells(self) -> list[JobCell]:
        """Every cell in index order: prompts, then seeds, then Y values, then X values (fastest)."""
        x_count = len(self.x.values) if self.x else 1
        y_count = len(self.y.values) if self.y else 1
        cells: list[JobCell] = []
        for p, prompt in enumerate(self.prompts):
            for seed in self.seeds or [0]:
                for y in range(y_count):
                    for x in range(x_count):
                        cells.append(
                            JobCell(
                                len(cells),
                                p,
                                prompt,
                                seed,
                                x if self.x else None,
                                y if self.y else None,
                            )
                        )
        return cells

    def cell_count(self) -> int:
        return (
            len(self.prompts)
            * len(self.seeds or [0])
            * (len(self.x.values) if self.x else 1)
            * (len(self.y.values) if self.y else 1)
        )

    def parameters(self, cell: JobCell) -> CellParameters:
        """What ``cell`` runs with: the job's fixed values, with its X and Y values in place."""
        values: dict[str, Any] = {
            "steps": self.steps,
            "guidance": self.guidance,
            "size": self.size,
            "negative_prompt": self.negative_prompt,
            "model": self.model,
            "deploy": self.deploy,
            "voice": self.voice,
            "speed": self.speed,
        }
        for name, index in (("x", cell.x), ("y", cell.y)):
            axis = getattr(self, name)
            if axis is not None and index is not None:
                values[axis.param] = axis.values[index]
        return CellParameters(prompt=cell.prompt, seed=cell.seed, say=self.say, **values)

    def axes_of(self, cell: JobCell) -> dict[str, Any]:
        """The values that place ``cell`` in the grid (stored with its item)."""
        axes: dict[str, Any] = {"prompt_index": cell.prompt_index, "prompt": cell.prompt, "seed": cell.seed}
        for name, index in (("x", cell.x), ("y", cell.y)):
            axis = getattr(self, name)
            if axis is not None and index is not None:
                axes[name] = {"param": axis.param, "index": index, "value": axis.values[index]}
        return axes

    def with_defaults(self, model: str, seed: int | None = None) -> JobSpec:
        """The spec as stored: the model and the seeds fixed (a resumed job runs exactly what was asked)."""
        seeds = self.seeds or [seed if seed is not None else secrets.randbelow(2**31)]
        return self.model_copy(update={"model": self.model or model, "seeds": seeds})

    def label(self) -> str:
        return self.name or ", ".join(self.prompts)[:60]


@dataclass(frozen=True)
class JobCell:
    """One cell: a prompt, a seed and (when the job has them) an index into the X and Y values."""

    index: int
    prompt_index: int
    prompt: str
    seed: int
    x: int | None
    y: int | None


@dataclass(frozen=True)
class CellParameters:
    """Everything one cell runs with (``None``: the model's default)."""

    prompt: str
    seed: int
    steps: int | None
    guidance: float | None
    size: str | None
    negative_prompt: str | None
    model: str | None
    deploy: str | dict[str, Any] | None
    voice: str | None = None
    speed: float | None = None
    say: bool = False  # the prompt is the words to say (speak_text), audio only

    def width_height(self) -> tuple[int, int] | None:
        if self.size is None:
            return None
        match = SIZE_PATTERN.match(self.size)
        if match is None:  # parse_job_spec refuses these
            raise ValueError(f"size {self.size!r} is not WIDTHxHEIGHT")
        return int(match.group(1)), int(match.group(2))

    def fields(self) -> dict[str, Any]:
        """The generation fields (the API's names) this cell sets."""
        fields: dict[str, Any] = {"seed": self.seed}
        if self.steps is not None:
            fields["num_inference_steps"] = self.steps
        if self.guidance is not None:
            fields["guidance_scale"] = float(self.guidance)
        if self.negative_prompt is not None:
            fields["negative_prompt"] = self.negative_prompt
        size = self.width_height()
        if size is not None:
            fields["width"], fields["height"] = size
        if self.voice is not None:
            fields["voice"] = self.voice
        if self.speed is not None:
            fields["speed"] = float(self.speed)
        return fields


def value_label(param: str, value: Any, index: int) -> str:
    """How an axis value is named on the grid and in the queue."""
    if param == "negative_prompt":
        return f'negative "{value}"' if value else "no negative prompt"
    if param == "deploy":
        return f"deploy {value}" if isinstance(value, str) else f"deploy #{index + 1}"
    if param == "guidance":
        return f"guidance {float(value):g}"
    if param == "speed":
        return f"speed {float(value):g}x"
    return f"{param} {value}"


# -- checking a document ----------------------------------------------------------------------------

TOP_FIELDS = tuple(JobSpec.model_fields)
AXIS_FIELDS = tuple(JobAxis.model_fields)


def field_path(loc: Sequence[Any]) -> str:
    """``("x", "values", 1)`` -> ``x.values[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _pydantic_problems(exc: ValidationError) -> list[SpecProblem]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        # Union branches pydantic names in the location (deploy's ``str`` / ``dict[str,any]``) are not fields.
        loc = tuple(part for part in loc if not (isinstance(part, str) and ("[" in part or part == "str")))
        path = field_path(loc)
        if path == "deploy":  # both union branches failed: say what either would take
            problems.append(SpecProblem(path, check_value("deploy", error.get("input"), InputLimits()) or ""))
            problems = list(dict.fromkeys(problems))
            continue
        if error["type"] == "extra_forbidden":
            allowed = AXIS_FIELDS if len(loc) == 2 and loc[0] in AXIS_NAMES else TOP_FIELDS
            message = f"unknown field; the allowed fields are {', '.join(allowed)}"
        elif error["type"] == "missing":
            message = "required"
        elif path in ("voice", "speed"):  # say what is allowed, as the axes' values do
            message = check_value(path, error.get("input"), InputLimits()) or str(error["msg"])
        else:
            message = str(error["msg"]).removeprefix("Value error, ")
        problem = SpecProblem(path, message)
        if problem not in problems:
            problems.append(problem)
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_size(value: Any, limits: InputLimits) -> str | None:
    """Why ``value`` is not a usable size, or ``None``."""
    if not isinstance(value, str) or not SIZE_PATTERN.match(value):
        return f"{value!r} is not a size: give WIDTHxHEIGHT, e.g. '128x128'"
    width, height = (int(side) for side in value.split("x"))
    limit = limits.max_image_side
    if not (MIN_SIDE <= width <= limit and MIN_SIDE <= height <= limit):
        return f"{value!r}: each side must be from {MIN_SIDE} to {limit} pixels (--max-image-side)"
    return None


def check_value(param: str, value: Any, limits: InputLimits) -> str | None:
    """Why ``value`` cannot be a value of ``param``, or ``None`` (the allowed values are in the message)."""
    if param == "steps":
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limits.max_steps:
            return f"steps must be a whole number from 1 to {limits.max_steps} (--max-steps), got {value!r}"
    elif param == "guidance":
        if not _is_number(value) or not 0 <= float(value) <= 100:
            return f"guidance must be a number from 0 to 100, got {value!r}"
    elif param == "size":
        return check_size(value, limits)
    elif param == "negative_prompt":
        if not isinstance(value, str):
            return f"negative_prompt must be text, got {value!r}"
        if len(value) > limits.max_prompt_chars:
            return f"is {len(value)} characters; the limit is {limits.max_prompt_chars} (--max-prompt-chars)"
    elif param == "model":
        if not isinstance(value, str) or not value.strip():
            return f"model must be a model name, got {value!r}"
    elif param == "deploy":
        presets = deploy_presets()
        if isinstance(value, str):
            if value not in presets:
                return f"unknown deploy preset {value!r}; the presets are {', '.join(presets)} (or a mapping)"
        elif not isinstance(value, Mapping):
            return f"deploy must be a preset name ({', '.join(presets)}) or a deploy config mapping"
    elif param == "voice":
        # Which voices exist is the model's: the studio checks them when the job is submitted.
        if not isinstance(value, str) or not value.strip():
            return f"voice must be a voice name (the model's voices, e.g. Chelsie), got {value!r}"
    elif param == "speed" and (not _is_number(value) or not MIN_SPEED <= float(value) <= MAX_SPEED):
        return f"speed must be a number from {MIN_SPEED:g} to {MAX_SPEED:g} (1.0: as spoken), got {value!r}"
    return None


def _semantic_problems(spec: JobSpec, limits: InputLimits) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    limit, flag = (
        (limits.max_speech_chars, "--max-speech-chars")
        if spec.say
        else (limits.max_prompt_chars, "--max-prompt-chars")
    )
    for i, prompt in enumerate(spec.prompts):
        if not prompt.strip():
            problems.append(SpecProblem(f"prompts[{i}]", "is empty; give the text to generate"))
        elif len(prompt) > limit:
            problems.append(
                SpecProblem(f"prompts[{i}]", f"is {len(prompt)} characters; the limit is {limit} ({flag})")
            )
    for i, seed in enumerate(spec.seeds or []):
        if not 0 <= seed <= MAX_SEED:
            problems.append(SpecProblem(f"seeds[{i}]", f"must be from 0 to {MAX_SEED}, got {seed}"))
        elif seed in (spec.seeds or [])[:i]:
            problems.append(SpecProblem(f"seeds[{i}]", f"repeats seed {seed}; each seed once"))
    for name in AXIS_PARAMS:
        value = getattr(spec, name)
        if value is not None:
            problem = check_value(name, value, limits)
            if problem is not None:
                problems.append(SpecProblem(name, problem))
    axes = spec.axes()
    for name, axis in axes.items():
        if getattr(spec, axis.param) is not None:
            problems.append(
                SpecProblem(
                    axis.param,
                    f"is also the {name} axis ({name}.param: {axis.param}); give it in one place",
                )
            )
        seen: list[Any] = []
        for i, value in enumerate(axis.values):
            problem = check_value(axis.param, value, limits)
            if problem is not None:
                problems.append(SpecProblem(f"{name}.values[{i}]", problem))
            elif value in seen:
                first = seen.index(value)
                problems.append(
                    SpecProblem(f"{name}.values[{i}]", f"repeats {name}.values[{first}]; each value once")
                )
            seen.append(value)
    if "x" in axes and "y" in axes and axes["x"].param == axes["y"].param:
        others = ", ".join(p for p in AXIS_PARAMS if p != axes["x"].param)
        problems.append(
            SpecProblem(
                "y.param", f"x already varies {axes['x'].param}; the y axis must vary another ({others})"
            )
        )
    count = spec.cell_count()
    if count > MAX_CELLS:
        problems.append(
            SpecProblem(
                "",
                f"the job has {count} cells (prompts x seeds x x.values x y.values); the limit is {MAX_CELLS}",
            )
        )
    return problems


def _raw_value_problems(data: Mapping[str, Any], failed: set[str], limits: InputLimits) -> list[SpecProblem]:
    """The value problems of the fields that passed the type checks, so one report lists them all."""
    problems = []
    for name in ("steps", "guidance", "size", "negative_prompt", "voice", "speed"):
        value = data.get(name)
        if name not in failed and value is not None:
            problem = check_value(name, value, limits)
            if problem is not None:
                problems.append(SpecProblem(name, problem))
    for name in AXIS_NAMES:
        axis = data.get(name)
        if name in failed or not isinstance(axis, Mapping) or axis.get("param") not in AXIS_PARAMS:
            continue
        values = axis.get("values")
        for i, value in enumerate(values if isinstance(values, list) else []):
            problem = check_value(str(axis["param"]), value, limits)
            if problem is not None:
                problems.append(SpecProblem(f"{name}.values[{i}]", problem))
    return problems


def parse_job_spec(data: Any, limits: InputLimits | None = None, source: str | None = None) -> JobSpec:
    """A checked :class:`JobSpec` from a parsed document; raises :class:`JobSpecError` listing every problem."""
    limits = limits or InputLimits()
    if not isinstance(data, Mapping):
        kind = "nothing" if data is None else type(data).__name__
        raise JobSpecError(
            [SpecProblem("", f"a job is a mapping of fields ({', '.join(TOP_FIELDS)}), got {kind}")], source
        )
    try:
        spec = JobSpec.model_validate(dict(data))
    except ValidationError as exc:
        problems = _pydantic_problems(exc)
        failed = {problem.field.split(".")[0].split("[")[0] for problem in problems}
        raise JobSpecError(problems + _raw_value_problems(data, failed, limits), source) from None
    problems = _semantic_problems(spec, limits)
    if problems:
        raise JobSpecError(problems, source)
    return spec


def load_job_file(text: str, source: str | None = None, limits: InputLimits | None = None) -> JobSpec:
    """A job from YAML text (``omni-studio batch JOB.yaml``, the Batch tab's YAML box)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobSpecError([SpecProblem("", f"not valid YAML: {exc}")], source) from None
    return parse_job_spec(data, limits, source)
