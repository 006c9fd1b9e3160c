"""Diffusion stages on diffusers: batched denoising with per-step progress, previews and cancellation.

Model families subclass :class:`DiffusersStage` to load their pipeline and map jobs to ``__call__``
arguments; this module owns the call itself, the per-request generators and the step callback
(``callback_on_step_end``, the one hook diffusers gives for progress).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from engine.events import DiffusionStep
from engine.stages.base import StageCancelled, StageJob, StageRunner, intra_op_threads_for

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


class DiffusersStage(StageRunner):
    """A stage that turns its inputs into images with a diffusers pipeline."""

    kind = "diffusion"
    backend = "diffusers"
    pipe: DiffusionPipeline | None = None

    @property
    def pipeline(self) -> DiffusionPipeline:
        """The loaded pipeline (an error before ``load`` and after ``close``)."""
        if self.pipe is None:
            raise RuntimeError(f"stage {self.stage_id}: the diffusers pipeline is not loaded")
        return self.pipe

    @abstractmethod
    def load_pipeline(self) -> DiffusionPipeline:
        """Load the pipeline's components from ``self.model_path``."""

    @abstractmethod
    def call_kwargs(self, jobs: list[StageJob]) -> dict[str, Any]:
        """``__call__`` arguments for a batch of compatible jobs (prompts, sizes, steps, guidance...)."""

    def load(self) -> None:
        pipe = self.load_pipeline()
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self._threads = intra_op_threads_for(
            [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)], self.device
        )
        self.loaded = True

    _threads: int | None = None

    @property
    def intra_op_threads(self) -> int | None:
        return self._threads

    def close(self) -> None:
        self.pipe = None
        super().close()

    def batch_key(self, job: StageJob) -> Hashable:
        p = job.params
        # Requests batch only when they share every shape- and schedule-defining parameter.
        return (
            p.get("height"),
            p.get("width"),
            p.get("num_inference_steps"),
            p.get("guidance_scale"),
            p.get("negative_prompt"),
            job.inputs.get("image") is not None,
            id(job) if job.inputs.get("image") is not None else None,
        )

    def total_steps(self, job: StageJob) -> int:
        return int(job.params.get("num_inference_steps") or 0)

    def latents_to_images(self, latents: torch.Tensor) -> list[Image.Image]:
        """Decode latents the way the pipeline does at the end (used for previews)."""
        pipe = self.pipeline
        vae = pipe.vae
        latents = latents.to(vae.dtype)
        scaling = getattr(vae.config, "scaling_factor", 1.0) or 1.0
        shift = getattr(vae.config, "shift_factor", 0.0) or 0.0
        image = vae.decode(latents / scaling + shift, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")

    def _step_callback(self, jobs: list[StageJob], total: int):
        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            done = step + 1
            latents = tensors.get("latents")
            for row, job in enumerate(jobs):
                preview = None
                every = int(job.params.get("preview_every") or 0)
                if every and latents is not None and done % every == 0 and done < total and not job.cancelled:
                    with torch.inference_mode():
                        preview = self.latents_to_images(latents[row : row + 1].clone())[0]
                job.emit(
                    DiffusionStep(
                        job.request_id, job.index, self.stage_id, step=done, total=total, preview=preview
                    )
                )
            if all(job.cancelled for job in jobs):
                # Out of the pipeline at once: no remaining steps and no VAE decode (seconds at real sizes).
                raise StageCancelled()
            return {}

        return on_step_end

    def run(self, jobs: list[StageJob]) -> None:
        live = [job for job in jobs if not job.cancelled]
        if not live:
            raise StageCancelled()
        total = int(live[0].params["num_inference_steps"])
        generators = [torch.Generator(device="cpu").manual_seed(int(job.params["seed"])) for job in live]
        kwargs = self.call_kwargs(live)
        with torch.inference_mode():
            result = self.pipeline(
                **kwargs,
                num_inference_steps=total,
                generator=generators[0] if len(generators) == 1 else generators,
                callback_on_step_end=self._step_callback(live, total),
                callback_on_step_end_tensor_inputs=["latents"],
                output_type="pil",
            )
        if all(job.cancelled for job in live):
            raise StageCancelled()
        for job, image in zip(live, result.images, strict=True):
            job.output_tokens = 0
            job.add_output({"image": [image]})
