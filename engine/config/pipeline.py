"""Resolving a deploy config against a model family's built-in topology into a validated pipeline config.

The result, :class:`PipelineConfig`, is what the engine builds from and what the run store snapshots:
every stage with its kind, sources, outputs, engine args and default sampling parameters spelled out.
Its :meth:`PipelineConfig.config_hash` identifies the configuration in fingerprints and history.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from engine.config.deploy import (
    CHUNK_SIZE_MAX,
    ENGINE_ARG_KEYS,
    SAMPLING_PARAMS_BY_KIND,
    TOPOLOGY_KEYS,
    DeployConfig,
    RayConfig,
    StageConfig,
)
from engine.config.errors import ConfigProblem, DeployConfigError
from engine.config.loader import problems_from_validation_error
from engine.events import StageKind
from engine.modality import (
    ModalityError,
    OutputModality,
    format_output_modalities,
    parse_output_modalities,
)

# What each stage kind can produce; a configured engine_output_type must stay within it.
PRODUCIBLE_BY_KIND: dict[str, tuple[OutputModality, ...]] = {
    "ar": (OutputModality.TOKEN_IDS, OutputModality.TEXT),
    "diffusion": (OutputModality.IMAGE, OutputModality.LATENT),
}
# The stage kind each hand-off feeds (Qwen2.5-Omni's talker is an AR stage fed by the thinker).
PROCESSOR_FEEDS: dict[str, str] = {
    "ar2diffusion": "diffusion",
    "thinker2talker": "ar",
    "talker2code2wav": "diffusion",
}


@dataclass(frozen=True)
class DevicePlacement:
    """A stage's ``devices``, parsed: ``auto`` (GPU 0 if there is one, else the CPU), ``cpu``, or GPU indices."""

    spec: str  # as written in the config: auto | cpu | '0' | '0,1'
    gpus: tuple[int, ...] = ()  # the GPU indices named; empty for auto and cpu

    @classmethod
    def parse(cls, value: str | None) -> DevicePlacement:
        spec = str(value or "auto")
        if spec in ("auto", "cpu"):
            return cls(spec)
        return cls(spec, tuple(int(d) for d in spec.split(",")))

    @property
    def is_auto(self) -> bool:
        return self.spec == "auto"

    @property
    def is_cpu(self) -> bool:
        return self.spec == "cpu"


@dataclass(frozen=True)
class StageEngineArgs:
    """A stage's engine args (vLLM names), with the defaults a stage gets when nothing sets them.

    Fields hold what the config says (``None`` where a deploy file wrote ``null``), so the resolved
    config, and its hash, record exactly what was asked for; the properties give the values runners use.
    """

    max_num_seqs: int | None = 1
    gpu_memory_utilization: float | None = 0.9
    enforce_eager: bool | None = True
    trust_remote_code: bool | None = False
    enable_prefix_caching: bool | None = False
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    devices: str | None = "auto"
    tensor_parallel_size: int | None = 1
    pipeline_parallel_size: int | None = 1
    kv_cache_memory_bytes: int | None = None
    dtype: str | None = "auto"
    distributed_executor_backend: str | None = None  # vLLM's executor (AR stages); None: vLLM's choice
    own_process: bool | None = None  # the model runs in a child process (embedded mode; docs/batching.md)
    # Upstream tokens per chunk when the stage consumes its AR source while it generates (None: once it
    # has finished); docs/speech.md, "Streaming".
    chunk_size: int | None = None
    num_replicas: int | None = None  # Ray actors for the stage (docs/distributed.md); None: one
    resources: dict[str, float] | None = None  # custom Ray resources each actor asks for

    @cached_property
    def placement(self) -> DevicePlacement:
        return DevicePlacement.parse(self.devices)

    @property
    def batch_size(self) -> int:
        """Requests a stage runs at once (``max_num_seqs``)."""
        return int(self.max_num_seqs or 1)

    @property
    def tensor_parallel(self) -> int:
        return int(self.tensor_parallel_size or 1)

    @property
    def pipeline_parallel(self) -> int:
        return int(self.pipeline_parallel_size or 1)

    @property
    def dtype_name(self) -> str:
        return self.dtype or "auto"

    @property
    def replicas(self) -> int:
        """Ray actors the stage runs as (``num_replicas``; 1 when unset)."""
        return int(self.num_replicas or 1)

    def to_dict(self) -> dict[str, Any]:
        """The engine args that decide what a stage computes (the snapshot, the hash, PNG recipes).

        Placement (a process of its own, ``num_replicas`` and ``resources`` on a Ray cluster) changes no output and is left out,
        so a pipeline on Ray snapshots, hashes and writes PNGs exactly like the same pipeline embedded
        (docs/distributed.md). Keys added after the first release appear only when set, so a config that
        does not use them keeps its hash (and the fingerprints and history rows made from it).
        """
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PLACEMENT_ENGINE_ARGS}
        for key in OPTIONAL_ENGINE_ARGS:
            if data[key] is None:
                del data[key]
        return data


# Engine args left out of the config dict when unset (see StageEngineArgs.to_dict).
OPTIONAL_ENGINE_ARGS = ("distributed_executor_backend", "chunk_size")
# Where a stage runs and how many copies: never in the config dict (see StageEngineArgs.to_dict).
PLACEMENT_ENGINE_ARGS = ("own_process", "num_replicas", "resources")

ENGINE_ARG_FIELDS = tuple(f.name for f in fields(StageEngineArgs))
assert set(ENGINE_ARG_FIELDS) == set(ENGINE_ARG_KEYS), "StageEngineArgs and StageConfig disagree"


@dataclass(frozen=True)
class StageTemplate:
    """A stage of a built-in topology: the defaults a deploy file may override."""

    stage_id: int
    kind: str
    input_sources: tuple[int, ...]
    engine_output_type: str
    final_output: bool
    final_output_type: str | None = None
    input_processor: str | None = None
    backend: str = "auto"
    engine_args: dict[str, Any] = field(default_factory=dict)  # overrides of StageEngineArgs' defaults
    default_sampling_params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedStage:
    """A stage with nothing left to defaults."""

    stage_id: int
    kind: StageKind
    input_sources: tuple[int, ...]
    engine_output_type: str
    final_output: bool
    final_output_type: str | None
    input_processor: str | None
    backend: str
    engine_args: StageEngineArgs
    default_sampling_params: dict[str, Any]

    @property
    def output_modalities(self) -> tuple[OutputModality, ...]:
        return parse_output_modalities(self.engine_output_type)

    @property
    def final_modalities(self) -> tuple[OutputModality, ...]:
        return parse_output_modalities(self.final_output_type or self.engine_output_type)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["engine_args"] = self.engine_args.to_dict()
        data["kind"] = self.kind.value  # a plain string, as YAML and JSON writers expect
        data["input_sources"] = list(self.input_sources)
        return data


@dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline: model family, model identity and resolved stages."""

    family: str
    model_name: str
    model_identity: str  # stable across machines: built-in recipe version or a hash of the model's configs
    async_chunk: bool
    stages: tuple[ResolvedStage, ...]
    # The deploy file's ``ray:`` section: where stages run, not what they compute (out of the hash).
    ray: RayConfig | None = field(default=None, compare=False)

    def stage(self, stage_id: int) -> ResolvedStage:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(stage_id)

    @property
    def entry_stages(self) -> tuple[ResolvedStage, ...]:
        return tuple(s for s in self.stages if not s.input_sources)

    @property
    def final_stages(self) -> tuple[ResolvedStage, ...]:
        return tuple(s for s in self.stages if s.final_output)

    def stages_for(self, modalities: tuple[OutputModality, ...]) -> frozenset[int]:
        """The stages a request for ``modalities`` runs: the final stages that produce one of them and
        every stage those read from (``text`` from Qwen2.5-Omni runs its thinker alone); all stages when
        no final stage produces any of them."""
        wanted = set(modalities)
        needed = {s.stage_id for s in self.final_stages if wanted & set(s.final_modalities)}
        if not needed:
            return frozenset(s.stage_id for s in self.stages)
        frontier = list(needed)
        while frontier:
            for source in self.stage(frontier.pop()).input_sources:
                if source not in needed:
                    needed.add(source)
                    frontier.append(source)
        return frozenset(needed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "model": {"name": self.model_name, "identity": self.model_identity},
            "async_chunk": self.async_chunk,
            "stages": [s.to_dict() for s in self.stages],
        }

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the resolved pipeline (models, stages, engine args)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def hash8(self) -> str:
        return self.config_hash()[:8]

    def summary(self) -> str:
        """One line for the pipeline, one per stage (what ``validate`` prints and the Pipeline tab shows)."""
        lines = [
            f"model {self.model_name} ({self.family}), {len(self.stages)} stage(s), config hash {self.hash8}"
        ]
        for s in self.stages:
            sources = ",".join(map(str, s.input_sources)) or "request"
            parts = [
                f"stage {s.stage_id}",
                f"{s.kind:<9}",
                f"inputs={sources}",
                f"output={s.engine_output_type}" + (" (final)" if s.final_output else ""),
            ]
            if s.input_processor:
                parts.append(f"processor={s.input_processor}")
            if s.kind == "ar":
                parts.append(f"backend={s.backend}")
            parts.append(f"devices={s.engine_args.devices}")
            parts.append(f"max_num_seqs={s.engine_args.max_num_seqs}")
            if s.engine_args.own_process:
                parts.append("own process")
            if s.engine_args.num_replicas:
                parts.append(f"replicas={s.engine_args.num_replicas}")
            if s.engine_args.resources:
                parts.append(
                    "resources=" + ",".join(f"{k}:{v:g}" for k, v in s.engine_args.resources.items())
                )
            lines.append("  " + "  ".join(parts))
        return "\n".join(lines)

    @property
    def tensor_parallel_size(self) -> int:
        return max(s.engine_args.tensor_parallel for s in self.stages)

    @property
    def pipeline_parallel_size(self) -> int:
        return max(s.engine_args.pipeline_parallel for s in self.stages)


def a_stage(kind: str) -> str:
    """``'an AR stage'``, ``'a diffusion stage'``: a stage kind as messages spell it."""
    return {"ar": "an AR stage", "diffusion": "a diffusion stage"}.get(kind, f"a {kind} stage")


def _template_modalities(template: StageTemplate | None, kind: str) -> tuple[OutputModality, ...]:
    """What a family's built-in stage declares beyond its kind's usual outputs (Qwen2.5-Omni's thinker
    is an AR stage that also emits ``latent``, its code2wav a diffusion stage that emits ``audio``)."""
    if template is None or template.kind != kind:
        return ()
    declared = [template.engine_output_type, template.final_output_type]
    extra = [m for value in declared if value for m in parse_output_modalities(value)]
    return tuple(dict.fromkeys(m for m in extra if m not in PRODUCIBLE_BY_KIND[kind]))


def _merge_stage(
    template: StageTemplate | None, stage: StageConfig | None, problems: list[ConfigProblem]
) -> ResolvedStage | None:
    sid = stage.stage_id if stage is not None else template.stage_id  # type: ignore[union-attr]
    overrides = stage.model_dump(exclude_unset=True) if stage is not None else {}
    if template is None and overrides.get("kind") is None:
        problems.append(
            ConfigProblem(
                sid, "kind", "stage is not in the built-in topology, so it must set kind: ar or diffusion"
            )
        )
        return None
    if template is not None and overrides.get("kind") not in (None, template.kind):
        problems.append(
            ConfigProblem(
                sid,
                "kind",
                f"this model's stage {sid} is {template.kind!r}, not {overrides['kind']!r}; "
                f"allowed value: {template.kind!r}",
            )
        )
        return None
    kind = overrides.get("kind") or template.kind  # type: ignore[union-attr]

    def pick(key: str, default: Any) -> Any:
        return overrides.get(key, default)

    base_topology = {k: getattr(template, k) for k in TOPOLOGY_KEYS} if template else {}
    input_sources = pick("input_sources", base_topology.get("input_sources", ()))
    engine_output_type = pick("engine_output_type", base_topology.get("engine_output_type"))
    final_output = pick("final_output", base_topology.get("final_output", False))
    final_output_type = pick("final_output_type", base_topology.get("final_output_type"))
    input_processor = pick("input_processor", base_topology.get("input_processor"))
    backend = pick("backend", base_topology.get("backend", "auto"))

    engine_args = StageEngineArgs(
        **{
            **(template.engine_args if template else {}),
            **{k: overrides[k] for k in ENGINE_ARG_KEYS if k in overrides},
        }
    )

    sampling = dict(template.default_sampling_params) if template else {}
    sampling.update(overrides.get("default_sampling_params") or {})
    model = SAMPLING_PARAMS_BY_KIND[kind]
    try:
        model.model_validate(sampling)
    except ValidationError as exc:
        problems += problems_from_validation_error(exc, model, sid, prefix="default_sampling_params.")

    for key, value in (("engine_output_type", engine_output_type), ("final_output_type", final_output_type)):
        if value is None and key == "final_output_type":
            continue
        try:
            modalities = parse_output_modalities(value)
        except ModalityError as exc:
            problems.append(ConfigProblem(sid, key, str(exc)))
            continue
        producible = PRODUCIBLE_BY_KIND[kind] + _template_modalities(template, kind)
        unsupported = [m for m in modalities if m not in producible]
        if unsupported:
            problems.append(
                ConfigProblem(
                    sid,
                    key,
                    f"{a_stage(kind)} cannot produce {format_output_modalities(tuple(unsupported))}; "
                    f"allowed: {', '.join(m.value for m in producible)} (or a '+' combination)",
                )
            )
    if backend != "auto" and kind != "ar":
        problems.append(
            ConfigProblem(
                sid, "backend", f"backend applies to AR stages only; {a_stage(kind)} always runs on diffusers"
            )
        )
    if input_processor is not None and kind != PROCESSOR_FEEDS.get(input_processor, kind):
        problems.append(
            ConfigProblem(
                sid,
                "input_processor",
                f"{input_processor} feeds {a_stage(PROCESSOR_FEEDS[input_processor])}; remove it here",
            )
        )
    problems += _parallelism_problems(sid, kind, backend, engine_args)

    return ResolvedStage(
        stage_id=sid,
        kind=StageKind(kind),
        input_sources=tuple(input_sources or ()),
        engine_output_type=engine_output_type if engine_output_type is not None else "text",
        final_output=bool(final_output),
        final_output_type=final_output_type,
        input_processor=input_processor,
        backend=backend,
        engine_args=engine_args,
        default_sampling_params=sampling,
    )


def _parallelism_problems(sid: int, kind: str, backend: str, args: StageEngineArgs) -> list[ConfigProblem]:
    """vLLM's own scale-out keys (docs/vllm.md): AR stages on vLLM only, and enough GPUs for them."""
    problems = []
    workers = args.tensor_parallel * args.pipeline_parallel
    if args.distributed_executor_backend is not None and kind != "ar":
        problems.append(
            ConfigProblem(
                sid,
                "distributed_executor_backend",
                f"applies to AR stages on vLLM; {a_stage(kind)} runs in one process",
            )
        )
    if kind == "ar" and backend == "transformers":
        for key, size in (
            ("tensor_parallel_size", args.tensor_parallel),
            ("pipeline_parallel_size", args.pipeline_parallel),
        ):
            if size > 1:
                problems.append(
                    ConfigProblem(
                        sid, key, f"{key} {size} needs vLLM; use backend: vllm (or auto), or {key}: 1"
                    )
                )
        if args.distributed_executor_backend is not None:
            problems.append(
                ConfigProblem(
                    sid,
                    "distributed_executor_backend",
                    "is vLLM's executor; use backend: vllm (or auto), or remove it",
                )
            )
    gpus = args.placement.gpus
    if kind == "ar" and gpus and workers > len(gpus) and args.distributed_executor_backend != "ray":
        problems.append(
            ConfigProblem(
                sid,
                "tensor_parallel_size",
                f"tensor_parallel_size {args.tensor_parallel} x pipeline_parallel_size {args.pipeline_parallel} "
                f"needs {workers} GPUs but devices {args.devices!r} lists {len(gpus)}; list {workers} GPUs "
                "(e.g. devices: '" + ",".join(str(i) for i in range(workers)) + "') or set "
                "distributed_executor_backend: ray to let vLLM place its workers on the Ray cluster",
            )
        )
    return problems


def _check_graph(stages: list[ResolvedStage], problems: list[ConfigProblem]) -> None:
    ids = {s.stage_id for s in stages}
    for stage in stages:
        for source in stage.input_sources:
            if source == stage.stage_id:
                problems.append(
                    ConfigProblem(stage.stage_id, "input_sources", "a stage cannot take its own output")
                )
            elif source not in ids:
                problems.append(
                    ConfigProblem(
                        stage.stage_id,
                        "input_sources",
                        f"input source {source} is not a stage; stages are {sorted(ids)}",
                    )
                )
    if stages and not any(not s.input_sources for s in stages):
        problems.append(ConfigProblem(None, "stages", "no entry stage: every stage has input_sources"))
    if stages and not any(s.final_output for s in stages):
        problems.append(ConfigProblem(None, "stages", "no terminal stage: no stage has final_output: true"))
    # Cycles (beyond self-loops) would never finish a request.
    graph = {s.stage_id: [src for src in s.input_sources if src in ids and src != s.stage_id] for s in stages}
    state: dict[int, int] = {}

    def visit(node: int) -> bool:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1 or (state.get(nxt) is None and visit(nxt)):
                return True
        state[node] = 2
        return False

    for node in graph:
        if state.get(node) is None and visit(node):
            problems.append(ConfigProblem(None, "stages", "input_sources form a cycle"))
            break


def _check_chunking(stages: list[ResolvedStage], problems: list[ConfigProblem]) -> None:
    """``chunk_size``: a stage reads its one source in chunks while it generates, so that source must be
    an AR stage (partial outputs are the tokens generated so far)."""
    kinds = {s.stage_id: s.kind for s in stages}
    for stage in stages:
        size = stage.engine_args.chunk_size
        if size is None:
            continue
        sources = stage.input_sources
        if len(sources) != 1 or kinds.get(sources[0]) != StageKind.AR:
            described = ", ".join(f"{sid} ({kinds.get(sid, '?')})" for sid in sources) or "none"
            problems.append(
                ConfigProblem(
                    stage.stage_id,
                    "chunk_size",
                    f"a stage consumes its input in chunks only from one AR stage; its input_sources are "
                    f"{described}; allowed: an integer from 1 to {CHUNK_SIZE_MAX} on a stage fed by one "
                    "AR stage, or null (whole input once the source has finished)",
                )
            )


def resolve_pipeline_config(
    deploy: DeployConfig | None,
    family: str,
    templates: tuple[StageTemplate, ...],
    model_name: str,
    model_identity: str,
    source: str | None = None,
    prior_problems: list[ConfigProblem] | None = None,
) -> PipelineConfig:
    """Merge ``deploy`` over the family's built-in ``templates`` and validate the result.

    Raises :class:`DeployConfigError` listing every problem found, including ``prior_problems`` (those
    the loader found in keys it had to drop).
    """
    problems: list[ConfigProblem] = list(prior_problems or [])
    deploy = deploy or DeployConfig()
    stages_given = "stages" in deploy.model_fields_set
    if stages_given and not deploy.stages and not problems:
        raise DeployConfigError([ConfigProblem(None, "stages", "no stages: the list is empty")], source)

    seen: dict[int, StageConfig] = {}
    for stage in deploy.stages:
        if stage.stage_id in seen:
            problems.append(ConfigProblem(stage.stage_id, "stage_id", f"duplicate stage id {stage.stage_id}"))
            continue
        seen[stage.stage_id] = stage

    by_id = {t.stage_id: t for t in templates}
    resolved: list[ResolvedStage] = []
    for sid in sorted(set(by_id) | set(seen)):
        merged = _merge_stage(by_id.get(sid), seen.get(sid), problems)
        if merged is not None:
            resolved.append(merged)
    if not resolved and not problems:
        problems.append(ConfigProblem(None, "stages", "no stages"))
    _check_graph(resolved, problems)
    _check_chunking(resolved, problems)
    if problems:
        raise DeployConfigError(problems, source)
    return PipelineConfig(
        family=family,
        model_name=model_name,
        model_identity=model_identity,
        async_chunk=bool(deploy.async_chunk),
        stages=tuple(resolved),
        ray=deploy.ray,
    )
