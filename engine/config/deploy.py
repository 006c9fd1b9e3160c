"""Deploy config models: the vllm-omni deploy YAML (top level and per stage) plus stage topology.

Every model forbids unknown keys: a misspelt key is reported, never silently passed through. Types are
strict (``'0.5'`` is not a number), with the one lenience that ``devices`` may be written as an int.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

StageKind = Literal["ar", "diffusion"]
ARBackend = Literal["auto", "vllm", "transformers"]
InputProcessorName = Literal["ar2diffusion"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

DEVICES_PATTERN = re.compile(r"^(auto|cpu|\d+(,\d+)*)$")


def _devices_to_str(value: Any) -> Any:
    # YAML turns `devices: 0` into an int; `devices: '0'` (the seed's spelling) stays a string.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


Devices = Annotated[str, BeforeValidator(_devices_to_str), Field(pattern=DEVICES_PATTERN.pattern)]


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

    # Checked against the stage kind once the topology is resolved.
    default_sampling_params: dict[str, Any] | None = None


class DeployConfig(StrictModel):
    """A deploy file: top-level switches and the list of stages."""

    async_chunk: bool | None = None
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
