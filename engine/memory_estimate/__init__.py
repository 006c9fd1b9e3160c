"""How much memory each stage will take, from the checkpoint's files, without loading it (docs/memory.md).

For every stage: its components' weights (parameter counts and dtypes from the safetensors headers, never
a tensor: :mod:`~engine.memory_estimate.checkpoints`), the KV cache of an AR stage (``max_num_seqs``
sequences of ``max_model_len`` tokens, per token as the AR stages compute it) and a margin for activations
and runtime (:mod:`~engine.memory_estimate.stages`); summed per device (a stage's ``devices``) against what
the device has free (:mod:`~engine.memory_estimate.devices`). ``omni-studio validate --check-devices`` and
the Pipeline tab's Validate print it and report a device that cannot hold its stages, with the deploy keys
that would make them fit (:mod:`~engine.memory_estimate.estimate`).
"""

from engine.memory_estimate.checkpoints import (
    CheckpointError,
    ComponentWeights,
    TensorHeader,
    checkpoint_files,
    component_weights,
    read_safetensors_header,
)
from engine.memory_estimate.devices import DeviceBudget, device_budget, machine_ram
from engine.memory_estimate.estimate import MemoryEstimate, estimate_memory, format_bytes, format_count
from engine.memory_estimate.stages import KvCache, StageMemory, estimate_stage, stage_components, text_config

__all__ = [
    "CheckpointError",
    "ComponentWeights",
    "DeviceBudget",
    "KvCache",
    "MemoryEstimate",
    "StageMemory",
    "TensorHeader",
    "checkpoint_files",
    "component_weights",
    "device_budget",
    "estimate_memory",
    "estimate_stage",
    "format_bytes",
    "format_count",
    "machine_ram",
    "read_safetensors_header",
    "stage_components",
    "text_config",
]
