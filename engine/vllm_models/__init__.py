"""Out-of-tree vLLM models: GLM-Image's AR model, registered with vLLM's model registry.

vLLM 0.32 has no ``GlmImageForConditionalGeneration``. :func:`register` maps that architecture name to
our implementation. It runs in every process vLLM starts (engine core, workers, and the subprocess that
inspects model classes) through the ``vllm.general_plugins`` entry point in ``pyproject.toml``; the vLLM
stage runner also calls it directly, so a source checkout without the entry point works in-process.

Importing this package does not import vLLM (the engine imports it only when vLLM is installed).
"""

from __future__ import annotations

GLM_IMAGE_ARCHITECTURE = "GlmImageForConditionalGeneration"
GLM_IMAGE_MODEL = "engine.vllm_models.glm_image:GlmImageForConditionalGeneration"
GLM_IMAGE_WORKER_EXTENSION = "engine.vllm_models.glm_image.GlmImageWorkerExtension"


def register() -> None:
    """Register our models with vLLM (idempotent; lazy: the model module is imported when used)."""
    from vllm import ModelRegistry

    if not _is_ours(ModelRegistry):
        ModelRegistry.register_model(GLM_IMAGE_ARCHITECTURE, GLM_IMAGE_MODEL)


def _is_ours(registry: object) -> bool:
    entry = getattr(registry, "models", {}).get(GLM_IMAGE_ARCHITECTURE)
    return getattr(entry, "module_name", None) == GLM_IMAGE_MODEL.split(":")[0]
