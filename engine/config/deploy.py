"""Deploy config models: the vllm-omni deploy YAML (top level and per stage) plus stage topology.

Every model forbids unknown keys: a misspelt key is reported, never silently passed through. Types are
strict (``'0.5'`` is not a number), with the one lenience that ``devices`` may be written as an int.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

StageKind = Literal["ar", "diffusion"]
ARBackend = Literal["auto", "vllm", "transformers"]
InputProcessorName = Literal["ar2diffusion", "thinker2talker", "talker2code2wav"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's executors for a stage's workers (``distributed_executor_backend``): Ray spans nodes, ``mp`` is one
# machine's processes, ``uni`` one process (docs/vllm.md).
ExecutorBackend = Literal["ray", "mp", "uni"]
# Ray's built-in resources: a stage asks for GPUs with ``devices``, never through ``resources``.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

# The largest ``chunk_size`` (upstream tokens per chunk) a stage may consume its input in.
CHUNK_SIZE_MAX = 4096

DEVICES_PATTERN = re.compile(r"^(auto|cpu|\d+(,\d+)*)$")


def _devices_to_str(value: Any) -> Any:
    # YAML turns `devices: 0` into an int; `devices: '0'` (the seed's spelling) stays a string.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


Devices = Annotated[str, BeforeValidator(_devices_to_str), Field(pattern=DEVICES_PATTERN.pattern)]


def _check_resources(value: dict[str, float]) -> dict[str, float]:
    for name, amount in value.items():
        if not name.strip() or name != name.strip():
            raise ValueError(f"resource name {name!r} must be a non-empty name without surrounding spaces")
        if name in RAY_BUILTIN_RESOURCES:
            raise ValueError(
                f"{name!r} is one of Ray's built-in resources ({', '.join(RAY_BUILTIN_RESOURCES)}); "
                "ask for GPUs with devices (e.g. devices: '0'), and name only custom resources here"
            )
        if not math.isfinite(amount) or amount <= 0:
            raise ValueError(f"resource {name!r} must be a positive number, got {amount!r}")
    return value


# A stage's custom Ray resources (``{node_a: 1}``): the actor goes to a node that has them (docs/distributed.md).
ResourceMap = Annotated[dict[str, float], AfterValidator(_check_resources)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


class ARSamplingParams(StrictModel):
    """Default sampling parameters of an autoregressive stage (vLLM ``SamplingParams`` names)."""

    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    detokenize: bool | None = None


class DiffusionSamplingParams(StrictModel):
    """Default generation parameters of a diffusion stage (diffusers ``__call__`` names)."""

    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    height: int | None = Field(None, ge=16, le=8192)
    width: int | None = Field(None, ge=16, le=8192)
    negative_prompt: str | None = None


SAMPLING_PARAMS_BY_KIND: dict[str, type[StrictModel]] = {
    "ar": ARSamplingParams,
    "diffusion": DiffusionSamplingParams,
}


class StageConfig(StrictModel):
    """One stage of a deploy file: topology (optional when a built-in topology supplies it) and engine args."""

    stage_id: int = Field(ge=0)

    # Topology. Omitted keys come from the model family's built-in topology.
    kind: StageKind | None = None
    input_sources: list[Annotated[int, Field(ge=0)]] | None = None
    final_output: bool | None = None
    final_output_type: str | None = None
    engine_output_type: str | None = None
    input_processor: InputProcessorName | None = None
    backend: ARBackend | None = None

    # Engine args (vLLM names). Those that only matter to vLLM are kept for the vLLM backend.
    max_num_seqs: int | None = Field(None, ge=1, le=1024)
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    enforce_eager: bool | None = None
    trust_remote_code: bool | None = None
    enable_prefix_caching: bool | None = None
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    devices: Devices | None = None
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    pipeline_parallel_size: int | None = Field(None, ge=1, le=64)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    dtype: DType | None = None
    distributed_executor_backend: ExecutorBackend | None = None

    # Run the stage's model in a process of its own (embedded mode; docs/batching.md).
    own_process: bool | None = None

    # Consume the upstream AR stage's output in chunks of this many of its tokens as it is generated
    # (Qwen2.5-Omni's code2wav renders codec ids while the talker speaks; docs/speech.md, "Streaming").
    chunk_size: int | None = Field(None, ge=1, le=CHUNK_SIZE_MAX)

    # Placement on a Ray cluster (``--ray-address``; docs/distributed.md). Embedded mode runs one copy.
    num_replicas: int | None = Field(None, ge=1, le=64)
    resources: ResourceMap | None = None

    # Checked against the stage kind once the topology is resolved.
    default_sampling_params: dict[str, Any] | None = None


class RayConfig(StrictModel):
    """The ``ray:`` section: run each stage as Ray actors on a cluster (docs/distributed.md).

    ``--ray-address`` on the command line overrides ``address``.
    """

    address: str | None = Field(None, min_length=1)  # 'auto', 'HOST:6379' or 'ray://HOST:10001'
    namespace: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    max_restarts: int = Field(4, ge=-1, le=1000)  # per actor; -1: without limit
    start_timeout_s: float = Field(300.0, gt=0, le=3600)  # for every actor to be placed and loaded


class DeployConfig(StrictModel):
    """A deploy file: top-level switches and the list of stages."""

    async_chunk: bool | None = None
    ray: RayConfig | None = None
    stages: list[StageConfig] = Field(default_factory=list)


TOPOLOGY_KEYS = (
    "kind",
    "input_sources",
    "final_output",
    "final_output_type",
    "engine_output_type",
    "input_processor",
    "backend",
)
ENGINE_ARG_KEYS = tuple(
    name
    for name in StageConfig.model_fields
    if name not in TOPOLOGY_KEYS + ("stage_id", "default_sampling_params")
)
