"""Stage 2, code2wav: codec ids -> 24 kHz mono float32 samples (token2wav: flow-matching DiT, BigVGAN).

transformers' ``Qwen2_5OmniToken2WavModel`` built from the checkpoint's ``token2wav`` weights, in float32
as the one-shot model runs it. The DiT integrates an ODE (Runge-Kutta 4, ``num_inference_steps`` time
points, classifier-free guidance ``guidance_scale``) from noise to a mel spectrogram conditioned on the
codes and the voice (``spk_dict.pt``: speaker embedding and reference mel); BigVGAN turns the mel into
samples. The starting noise comes from the RNG stream the talker handed on (``rng_state``), drawn from a
generator of this stage's own, so nothing here waits on the other stages' RNG lock. A whole render is
one request alone, as the one-shot model renders each sample; streamed chunks of several requests may
share a DiT batch, where the running machine's kernels give each window its alone bits
(engine/pipelines/qwen_omni/dit_batch.py): batching never changes a sample.

With ``chunk_size`` in the deploy config the stage renders while the talker speaks (engine/streaming.py):
chunk after chunk of ``chunk_size`` codes, each from a window of codes around it (the DiT's attention
blocks before and after it), one AudioDelta per chunk. Its noise then comes from the request's seed, as
the talker's stream is not known before the talker has finished (docs/speech.md, "Streaming").
"""

from __future__ import annotations

from typing import Any

import torch

from engine.events import AudioDelta, DiffusionStep
from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder, chunk_vocoder
from engine.pipelines.qwen_omni.checkpoint import SAMPLE_RATE, load_speakers, load_token2wav
from engine.pipelines.qwen_omni.code2wav_streams import ChunkScheduler, StreamRender, speed_of
from engine.pipelines.qwen_omni.dit_batch import BatchedFlow, DiTWindow
from engine.request import RequestError
from engine.stages.base import JobDone, StageCancelled, StageJob, StageRunner, intra_op_threads_for
from engine.streaming import CHUNK_FEED_KEY, ChunkFeed
from engine.tempo import stretch


class Code2WavStage(StageRunner):
    """Codes -> samples, one request at a time (``audio`` and ``sample_rate`` outputs): one AudioDelta
    for the whole utterance, or one per chunk when the stage consumes the talker's codes in chunks."""

    kind = "diffusion"
    sample_rate = SAMPLE_RATE
    consumes_chunks = True  # chunk_size may be set on this stage (engine/streaming.py)
    model: Any = None
    flow: BatchedFlow
    chunk_vocoder: Vocoder

    def load(self) -> None:
        self.model = load_token2wav(self.model_path).to(self.device)  # float32, as in the library
        self.flow = BatchedFlow(self.model.code2wav_dit_model)
        self.chunk_vocoder = chunk_vocoder(self.model.code2wav_bigvgan_model)  # streamed chunks' BigVGAN
        self.speakers = load_speakers(self.model_path)
        self.loaded = True

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        self.model = None
        super().close()

    @property
    def intra_op_threads(self) -> int | None:
        return None if self.model is None else intra_op_threads_for([self.model], self.device)

    def total_steps(self, job: StageJob) -> int:
        return int(job.params.get("num_inference_steps") or 0)

    def run(self, jobs: list[StageJob]) -> None:
        # A cancelled job stops here and the next one runs: the worker reports it cancelled, and its
        # neighbours in the batch are not cut short.
        for job in jobs:
            try:
                if job.cancelled:
                    raise StageCancelled()
                feed = job.inputs.get(CHUNK_FEED_KEY)
                with torch.inference_mode():
                    if feed is not None:
                        self.stream(job, feed)
                        continue
                    samples = self.render(job)
            except StageCancelled:
                continue
            samples = torch.from_numpy(stretch(samples.numpy(), speed_of(job)))
            self.send(job, samples)

    def stream(self, job: StageJob, feed: ChunkFeed) -> None:
        """Render the codes in chunks of ``chunk_size`` as the talker publishes them, on this thread: one
        AudioDelta (and one DiffusionStep) per chunk, in order; the chunks depend on the codes only."""
        render = StreamRender(self, job, feed)
        while True:
            feed.wait(render.ready, job)
            if render.step():
                return

    # -- many streams at once (docs/speech.md, "Many listeners") ---------------------------------------
    # With chunk_size set the runner is concurrent: the stage worker hands it each stream as it arrives
    # (up to max_num_seqs in flight) and one scheduler thread renders their chunks, the most urgent first.

    _scheduler: ChunkScheduler | None = None

    @property
    def concurrent(self) -> bool:  # type: ignore[override]  # a class attribute on the base; here the config's
        return bool(self.stage.engine_args.chunk_size)

    def submit(self, job: StageJob, done: JobDone) -> None:
        if self._scheduler is None:
            self._scheduler = ChunkScheduler(self)
        self._scheduler.submit(job, done)

    def send(self, job: StageJob, samples: torch.Tensor) -> None:
        """Add ``samples`` to the request's audio and hand them on (an AudioDelta)."""
        job.add_output({"audio": samples, "sample_rate": SAMPLE_RATE})
        job.emit(AudioDelta(job.request_id, job.index, self.stage_id, samples.numpy(), SAMPLE_RATE))

    def conditioning(self, job: StageJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The voice's speaker embedding (1, E) and reference mel (1, frames, mels), float32 here."""
        voice = str(job.params["voice"])
        speaker = self.speakers.get(voice)
        if speaker is None:
            raise RequestError(
                "voice", f"the model has no voice {voice!r}; allowed: {', '.join(self.speakers)}"
            )
        return speaker["cond"].to(self.device).float(), speaker["ref_mel"].to(self.device).float()

    def noise(self, job: StageJob, frames: int) -> torch.Tensor:
        """The ODE's starting point: the next normal draws of the stream the talker left (the request's
        seed when there is none), on a generator of this stage's own. On a GPU the one-shot model draws
        it on the GPU from the CUDA stream, so the draw happens there too (the same samples on a GPU as
        the one-shot there, measured by bench/gpu_speech_check.py)."""
        on_cuda = self.device.type == "cuda"
        generator = torch.Generator(device=self.device) if on_cuda else torch.Generator()
        state = job.inputs.get("rng_state")
        if state is None:
            generator.manual_seed(int(job.params["seed"]))
        else:
            generator.set_state(state["cuda" if on_cuda else "cpu"])
        mels = self.model.code2wav_dit_model.mel_dim
        return torch.randn((1, frames, mels), generator=generator, device=generator.device).to(self.device)

    def render(self, job: StageJob) -> torch.Tensor:
        """The request's codes as float32 samples (1-D, on the CPU)."""
        codes = torch.as_tensor(job.inputs["codes"]).reshape(1, -1).to(self.device)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        dit = self.model.code2wav_dit_model
        frames = codes.shape[1] * dit.repeats
        if frames > dit.config.max_position_embeddings:
            raise RequestError(
                "max_tokens",
                f"{codes.shape[1]} codes make {frames} mel frames; the DiT takes at most "
                f"{dit.config.max_position_embeddings}",
            )
        speaker, reference = self.conditioning(job)
        mel = self.integrate(job, codes, speaker, reference, self.noise(job, frames))
        return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    def integrate(
        self,
        job: StageJob,
        codes: torch.Tensor,
        speaker: torch.Tensor,
        reference: torch.Tensor,
        start: torch.Tensor,
        report: bool = True,
    ) -> torch.Tensor:
        """The DiT's flow from ``start`` (noise) to a mel (1, mels, frames), one DiffusionStep per step
        when ``report``: the library's forward bit for bit, without recomputing what does not change
        during the ODE (engine/pipelines/qwen_omni/dit_batch.py)."""
        window = self.window(job, codes, speaker, self.flow.voice(reference, self.guided(job)), start)
        steps = window.steps
        calls = [0]

        def check() -> None:
            if job.cancelled:
                raise StageCancelled()
            if report and calls[0] and calls[0] % 4 == 0:  # Runge-Kutta 4: four evaluations per step
                job.emit(
                    DiffusionStep(job.request_id, job.index, self.stage_id, step=calls[0] // 4, total=steps)
                )
            calls[0] += 1

        mel = self.flow.integrate([window], check)
        if report:
            job.emit(DiffusionStep(job.request_id, job.index, self.stage_id, step=steps, total=steps))
        return mel

    @staticmethod
    def guided(job: StageJob) -> bool:
        """Whether the request's DiT uses classifier-free guidance (two rows per window)."""
        return float(job.params.get("guidance_scale", 0.5)) >= 1e-5

    def window(
        self,
        job: StageJob,
        codes: torch.Tensor,
        speaker: torch.Tensor,
        voice: torch.Tensor,
        start: torch.Tensor,
        real: int | None = None,
    ) -> DiTWindow:
        """The request's window of ``codes`` from noise ``start`` (its steps and guidance); ``real``: its
        frames before any padding."""
        steps = int(job.params.get("num_inference_steps") or 10)
        guidance = float(job.params.get("guidance_scale", 0.5))
        return self.flow.window(codes, speaker, voice, start, guidance, steps, real)
