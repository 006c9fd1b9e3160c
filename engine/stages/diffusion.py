"""Diffusion stages on diffusers: batched denoising with per-step progress, previews and cancellation.

Model families subclass :class:`DiffusersStage` to load their pipeline and map jobs to ``__call__``
arguments; this module owns the call itself, the per-request generators and the step callback
(``callback_on_step_end``, the one hook diffusers gives for progress).

A family whose denoiser is batch-invariant once its linear layers multiply sample by sample (measured for
GLM-Image's DiT, docs/batching.md) sets ``batch_invariant``: its ``per_sample_modules`` get per-sample
linears while a batch runs, latents are decoded one sample at a time, and ``batch_group`` keeps apart the
jobs whose text inputs would be padded to each other's length. Each image is then bit-identical to the
one its request makes alone, so the stage can batch (deploy configs set how much, ``max_num_seqs``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import abstractmethod
from collections.abc import Hashable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from engine.events import DiffusionStep
from engine.stages.base import StageCancelled, StageJob, StageRunner, intra_op_threads_for

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

log = logging.getLogger("omni_studio.engine")


class _BatchSize(threading.local):
    """The batch the calling thread's pipeline call is running (1 outside one)."""

    size = 1


def _split(value: Any, n: int, i: int) -> Any:
    return (
        value[i : i + 1] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n else value
    )


def _joined(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, tuple | list):
        return type(first)(_joined([out[k] for out in outputs]) for k in range(len(first)))
    return first


def _per_sample_forward(forward: Any, batch: _BatchSize, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``; inside a batch of n whose first input has the batch as its first
    dimension, one sample at a time (arguments split where their first dimension is the batch)."""
    n = batch.size
    first = args[0] if args else next(iter(kwargs.values()), None)
    if n <= 1 or not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] != n:
        return forward(*args, **kwargs)
    return _joined(
        [
            forward(*[_split(a, n, i) for a in args], **{k: _split(v, n, i) for k, v in kwargs.items()})
            for i in range(n)
        ]
    )


def per_sample(modules: list[torch.nn.Module], batch: _BatchSize) -> None:
    """Make each module's forward run sample by sample while ``batch`` says a batch runs."""
    for module in modules:
        module.forward = partial(_per_sample_forward, module.forward, batch)


class DiffusersStage(StageRunner):
    """A stage that turns its inputs into images with a diffusers pipeline."""

    kind = "diffusion"
    backend = "diffusers"
    pipe: DiffusionPipeline | None = None
    batch_invariant = False  # see the module docstring

    def per_sample_modules(self, pipe: DiffusionPipeline) -> list[torch.nn.Module]:
        """The modules a batch-invariant family runs sample by sample inside a batch (its denoiser's linear
        layers: their kernel depends on the row count; small per-sample tensors: their vectorization)."""
        return []

    def batch_group(self, job: StageJob) -> Hashable:
        """What else must match for jobs to batch (a batch-invariant family: inputs padded together)."""
        return None

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
        self._batch = _BatchSize()
        if self.batch_invariant:
            per_sample(self.per_sample_modules(pipe), self._batch)
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
            self.batch_group(job),
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
        if len(live) == 1 or self._batches_identically(live):
            self._denoise(live)
            return
        for job in live:  # this shape does not batch bit-identically on this machine: one at a time
            with contextlib.suppress(StageCancelled):
                self._denoise([job])
        if all(job.cancelled for job in live):
            raise StageCancelled()

    def _call(self, jobs: list[StageJob], steps: int, output_type: str, **call: Any) -> Any:
        """One pipeline call for ``jobs`` (a batch when several), each with its own seed: its ``images``."""
        generators = [torch.Generator(device="cpu").manual_seed(int(job.params["seed"])) for job in jobs]
        self._batch.size = len(jobs)
        try:
            with torch.inference_mode():
                return self.pipeline(
                    **self.call_kwargs(jobs),
                    num_inference_steps=steps,
                    generator=generators[0] if len(generators) == 1 else generators,
                    output_type=output_type,
                    **call,
                ).images
        finally:
            self._batch.size = 1

    def _images(self, jobs: list[StageJob], steps: int, **call: Any) -> list[Image.Image | None]:
        """The jobs' pictures from one pipeline call (a batch when several), each with its own seed;
        None for a job cancelled meanwhile. A batch-invariant family decodes the latents one by one."""
        images = self._call(jobs, steps, "latent" if self.batch_invariant else "pil", **call)
        with torch.inference_mode():
            if all(job.cancelled for job in jobs):
                raise StageCancelled()
            if not self.batch_invariant:
                return list(images)
            # The VAE sample by sample too (convolutions pick kernels by batch).
            return [
                None if job.cancelled else self.latents_to_images(images[i : i + 1])[0]
                for i, job in enumerate(jobs)
            ]

    _batch_checks: dict[Hashable, bool] | None = None

    @property
    def batch_checks(self) -> dict[Hashable, bool]:
        """Batch key -> whether such batches proved bit-identical here (see ``_batches_identically``)."""
        return dict(self._batch_checks or {})

    def _batches_identically(self, jobs: list[StageJob]) -> bool:
        """Whether a batch gives each job the picture it gets alone, for jobs like these: checked once per
        batch key, with one denoising step for two of them alone and together (shapes decide kernels and
        vectorization, so one check per shape holds for every batch of it; docs/batching.md). A family
        that does not take care of it (``batch_invariant``) usually fails and runs one job at a time."""
        if self._batch_checks is None:
            self._batch_checks = {}
        key = self.batch_key(jobs[0])
        if key not in self._batch_checks:
            # The latents after one step, not pictures: a last-bit difference that rounds away in one
            # step's pixels still grows over the steps to come.
            pair = jobs[:2]
            alone = [self._call([job], 1, "latent")[0] for job in pair]
            together = self._call(pair, 1, "latent")
            same = all(torch.equal(a, together[i]) for i, a in enumerate(alone))
            if not same:
                log.warning(
                    "stage %s: batches of %s do not give each request its alone picture here; "
                    "running them one at a time",
                    self.stage_id,
                    key,
                )
            self._batch_checks[key] = same
        return self._batch_checks[key]

    def _denoise(self, live: list[StageJob]) -> None:
        total = int(live[0].params["num_inference_steps"])
        images = self._images(
            live,
            total,
            callback_on_step_end=self._step_callback(live, total),
            callback_on_step_end_tensor_inputs=["latents"],
        )
        for job, image in zip(live, images, strict=True):
            job.output_tokens = 0
            if image is not None:
                job.add_output({"image": [image]})
