"""GLM-Image stage 0 on vLLM (imported only when a stage runs on vLLM: importing vLLM takes seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.pipelines.glm_image.ar_transformers import (
    AR_COMPONENT,
    PROCESSOR_COMPONENT,
    GlmImageARStage,
    load_processor,
)
from engine.stages.ar_vllm import VllmARStage
from engine.stages.base import StageJob
from engine.stages.vllm_requests import VllmPrompt


class VllmGlmImageARStage(VllmARStage):
    """GLM-Image stage 0 on vLLM: text (+ source image) -> image-code ids.

    Prompts are built by the same code as the transformers stage (:class:`GlmImageARStage.prepare`).
    For I2I the source image's codes come from transformers' vision tower + VQ (only those weights are
    loaded; the decoder stays on the meta device), replace the ``<|image|>`` placeholders in the prompt
    as transformers' forward does, and leave as ``prior_image`` for the DiT.
    """

    skip_tokenizer_init = True
    worker_extension_cls = "engine.vllm_models.glm_image.GlmImageWorkerExtension"

    @property
    def vllm_model_path(self) -> Path:
        return self.model_path / AR_COMPONENT

    @property
    def tokenizer_path(self) -> Path | None:
        return self.model_path / PROCESSOR_COMPONENT

    def load_helpers(self) -> None:
        from engine.vllm_models import register

        register()
        self.reference = GlmImageARStage(self.stage, self.model_path, self.device)
        self.reference.processor = load_processor(self.model_path / PROCESSOR_COMPONENT)
        self.reference.model = _load_vision_encoder(self.vllm_model_path, self.torch_dtype, self.device)
        self.image_token_id = int(self.reference.model.config.image_token_id)

    def prepare(self, job: StageJob) -> VllmPrompt:
        prepared = self.reference.prepare(job)
        input_ids = prepared.model_inputs["input_ids"][0].cpu()
        extras = dict(prepared.extra_outputs)
        grids = None
        if "prior_image" in extras:
            placeholders = input_ids == self.image_token_id
            codes = extras["prior_image"].reshape(-1).to(input_ids.dtype)
            if int(placeholders.sum()) != codes.numel():
                raise ValueError(
                    f"{int(placeholders.sum())} image placeholders but {codes.numel()} source codes"
                )
            input_ids = input_ids.masked_scatter(placeholders, codes)
            grids = [[int(x) for x in g] for g in extras["prior_image_grid_thw"].tolist()]
        return VllmPrompt(input_ids.tolist(), prepared.max_new_tokens, extras, grids)


def _load_vision_encoder(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' ``GlmImageModel`` with only its vision tower and VQ loaded (the decoder on meta)."""
    from safetensors import safe_open
    from transformers import GlmImageConfig
    from transformers.models.glm_image.modeling_glm_image import (
        GlmImageModel,
        GlmImageVisionModel,
        GlmImageVQVAE,
    )

    config = GlmImageConfig.from_pretrained(path)
    with torch.device("meta"):
        model = GlmImageModel(config)
    model.visual = GlmImageVisionModel._from_config(config.vision_config, dtype=dtype)
    model.vqmodel = GlmImageVQVAE._from_config(config.vq_config, dtype=dtype)
    wanted = {"model.visual.": model.visual, "model.vqmodel.": model.vqmodel}
    states: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in wanted}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                for prefix in wanted:
                    if key.startswith(prefix):
                        states[prefix][key[len(prefix) :]] = handle.get_tensor(key)
    for prefix, module in wanted.items():
        missing, unexpected = module.load_state_dict(states[prefix], strict=False)
        missing = [k for k in missing if not k.endswith(("num_batches_tracked",))]
        if missing or unexpected:
            raise RuntimeError(
                f"{path}: {prefix} weights do not match (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        module.to(device=device, dtype=dtype).eval()
    return model
