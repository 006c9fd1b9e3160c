"""code2wav's streams (docs/speech.md, "Streaming" and "Many listeners"): where a streamed render's chunks
lie (:class:`ChunkPlan`), its noise (:class:`SeededNoise`), one stream rendered chunk by chunk
(:class:`StreamRender`) and the scheduler that serves many streams at once (:class:`ChunkScheduler`).

Every chunk is rendered from its codes, its noise rows and its voice only, and a batch of windows gives
each its alone bits (checked on the running machine, else rendered one by one), so a stream's samples are
the same whoever else is listening; the scheduler decides the order: the chunk whose listener runs out of
audio first goes next (a new stream's first chunk before anything already playing), with the other ready
chunks of its window's length in the same DiT batch.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.config import ResolvedStage
from engine.events import DiffusionStep, StageStatus
from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder
from engine.pipelines.qwen_omni.bigvgan_cpu import batch_holds as vocoder_batch_holds
from engine.pipelines.qwen_omni.code2wav_process import Code2WavProcess
from engine.pipelines.qwen_omni.dit_batch import BatchedFlow, DiTWindow, batch_holds
from engine.stages.base import JobDone, StageCancelled, StageJob
from engine.streaming import CANCEL_POLL_S, CHUNK_FEED_KEY, ChunkFeed
from engine.tempo import Tempo


class Code2WavStage(Protocol):
    """What the streams need of code2wav's runner (``engine/pipelines/qwen_omni/code2wav.py``)."""

    model: Any
    model_path: Path
    flow: BatchedFlow
    chunk_vocoder: Vocoder
    stage: ResolvedStage
    device: torch.device
    sample_rate: int

    @property
    def stage_id(self) -> int: ...

    @property
    def intra_op_threads(self) -> int | None: ...

    def conditioning(self, job: StageJob) -> tuple[torch.Tensor, torch.Tensor]: ...

    def guided(self, job: StageJob) -> bool: ...

    def window(
        self,
        job: StageJob,
        codes: torch.Tensor,
        speaker: torch.Tensor,
        voice: torch.Tensor,
        start: torch.Tensor,
        real: int | None = None,
    ) -> DiTWindow: ...

    def send(self, job: StageJob, samples: torch.Tensor) -> None: ...

    def run(self, jobs: list[StageJob]) -> None: ...


VOCODER_REACH_FRAMES = 16  # mel frames of context BigVGAN needs each side of a chunk (docs/speech.md)
# Every chunk after the first is this many times chunk_size: the first is small so the first sound comes
# soon; later ones render less context per second of audio (docs/speech.md, "Chunk sizes").
LATER_CHUNKS = 2
# Chunks of one length the second process vocodes in one call at most: per window 14 ms in a batch of four
# 64-frame windows against 21 alone, 13 in one of eight (docs/speech.md, "BigVGAN on the CPU").
VOCODER_BATCH = 4


def speed_of(job: StageJob) -> float:
    """The request's tempo (1.0: as spoken; engine/tempo.py)."""
    return float(job.params.get("speed") or 1.0)


def codes_in(inputs: Mapping[str, Any]) -> int:
    codes = inputs.get("codes")
    return 0 if codes is None else int(torch.as_tensor(codes).numel())


@dataclass(frozen=True)
class ChunkPlan:
    """Where a streamed render's chunks and their windows lie, in codes (docs/speech.md, "Streaming").

    The DiT attends within blocks of ``block`` codes (its ``block_size`` mel frames), one block back or
    ahead in the layers that list it; a chunk is rendered from a window reaching ``back`` codes before it
    and ``ahead`` codes past it (at least one block each way, and at least the vocoder's reach), its
    edges on block boundaries so the window's blocks are the whole render's.
    """

    chunk: int  # codes in the first chunk (the deploy config's chunk_size)
    later: int  # codes in every later chunk (LATER_CHUNKS x chunk)
    block: int  # codes per DiT attention block
    back: int  # codes of context before a chunk
    ahead: int  # codes of context after a chunk (what must exist before the chunk is rendered)
    repeats: int  # mel frames per code
    hop: int  # samples per mel frame

    @classmethod
    def of(cls, model: Any, chunk: int) -> ChunkPlan:
        dit, vocoder = model.code2wav_dit_model, model.code2wav_bigvgan_model
        repeats = int(dit.repeats)
        block = max(1, int(dit.block_size) // repeats)
        blocks_back = max(1, len(dit.config.look_backward_layers))
        blocks_ahead = max(1, len(dit.config.look_ahead_layers))
        # BigVGAN's convolutions reach about 16 mel frames either side (measured: docs/speech.md).
        reach = -(-VOCODER_REACH_FRAMES // repeats)
        back = max(blocks_back * block, reach)
        ahead = max(blocks_ahead * block, reach)
        later = chunk * LATER_CHUNKS
        return cls(chunk, later, block, back, ahead, repeats, int(math.prod(vocoder.config.upsample_rates)))

    def size(self, start: int) -> int:
        """Codes in the chunk starting at ``start`` when the utterance goes on past its window: the first
        is small (its audio comes soonest), later ones larger (less context rendered per second of audio)."""
        return self.chunk if start == 0 else self.later

    def reach(self, start: int) -> int:
        """The codes the window of the chunk starting at ``start`` reaches: the chunk's end and ``ahead``,
        to the end of that block."""
        return -(-(start + self.size(start) + self.ahead) // self.block) * self.block

    def ready_at(self, start: int) -> int:
        """The codes the talker must have said, while still speaking, before the chunk starting at
        ``start`` is rendered: its window and one more, which tells whether the utterance ends inside the
        window (then the chunk takes the rest: :meth:`end`)."""
        return self.reach(start) + 1

    def end(self, start: int, total: int | None) -> int:
        """Where the chunk starting at ``start`` ends; ``total`` when all the codes are known, None while
        the talker is still speaking. An utterance that ends inside the chunk's window (at or before
        :meth:`reach`) ends with this chunk: its window holds those codes anyway, so the rest costs no DiT
        window and no vocoder call of its own. The end depends on the codes only (a chunk is rendered
        before the talker has finished only when it has said more than :meth:`reach`)."""
        if total is not None and total <= self.reach(start):
            return total
        return start + self.size(start)

    def window(self, start: int, total: int | None) -> tuple[int, int]:
        """The codes [low, high) rendered for the chunk starting at ``start`` (``total`` as for
        :meth:`end`). A window past the last code stops at the end of that code's block: the codes from
        ``total`` to ``high`` are padding (so the last chunks of utterances of different lengths share a
        few window lengths, and a DiT batch)."""
        low = max(0, start - self.back) // self.block * self.block
        high = -(-(self.end(start, total) + self.ahead) // self.block) * self.block
        return low, high if total is None else min(high, -(-total // self.block) * self.block)

    def vocoder_frames(self) -> tuple[int, int]:
        """The mel frames the vocoder renders for a first chunk and for a later one inside the utterance:
        the chunk's own and the vocoder's reach either side (none before the first). Most chunks have one
        of these two lengths, so the second process vocodes them in batches (docs/speech.md, "BigVGAN on the CPU")."""
        return (
            self.chunk * self.repeats + VOCODER_REACH_FRAMES,
            self.later * self.repeats + 2 * VOCODER_REACH_FRAMES,
        )


class SeededNoise:
    """The ODE's starting noise for a streamed render, drawn from the request's seed frame by frame as
    windows reach further: the same rows a single draw of the whole utterance's frames gives (torch's
    CPU normal draws are prefix-stable for rows of ``mel_dim`` values; tested)."""

    def __init__(self, seed: int, mel_dim: int) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.mel_dim = mel_dim
        self.drawn = torch.zeros((1, 0, mel_dim))

    def frames(self, low: int, high: int) -> torch.Tensor:
        if high > self.drawn.shape[1]:
            more = torch.randn((1, high - self.drawn.shape[1], self.mel_dim), generator=self.generator)
            self.drawn = torch.cat([self.drawn, more], dim=1)
        return self.drawn[:, low:high]


@dataclass
class ChunkWork:
    """One chunk ready to render: its DiT window and where its samples lie in it."""

    window: DiTWindow
    low: int  # the window's first code
    start: int  # the chunk's first code
    end: int  # the chunk's end (codes)
    last: bool  # the utterance's last chunk
    seconds: float  # the chunk's audio, as played (its tempo applied)


class StreamRender:
    """One request's streamed render: :meth:`ready` says whether its next chunk's codes are in,
    :meth:`prepare` builds that chunk's DiT window, :meth:`deliver` turns the window's mel into the
    chunk's samples (one AudioDelta and one DiffusionStep); :meth:`step` does all three alone."""

    def __init__(self, stage: Code2WavStage, job: StageJob, feed: ChunkFeed) -> None:
        self.stage, self.job, self.feed = stage, job, feed
        self.plan = ChunkPlan.of(stage.model, int(stage.stage.engine_args.chunk_size or 1))
        self.speaker, reference = stage.conditioning(job)  # RequestError for a voice it lacks
        self.voice = stage.flow.voice(reference, stage.guided(job))  # the speaker encoder, once
        self.noise = SeededNoise(int(job.params["seed"]), stage.model.code2wav_dit_model.mel_dim)
        speed = speed_of(job)
        self.tempo = Tempo(speed) if speed != 1.0 else None
        self.start = 0  # the first code not rendered yet
        self.rendered = 0  # chunks rendered
        self.arrived = time.monotonic()
        self.first_sound: float | None = None  # when its first samples went out
        self.seconds_out = 0.0  # audio seconds sent so far
        self.seconds_queued = 0.0  # audio seconds past the DiT, not sent yet (at the vocoder)
        self.ended = False  # finished, failed or cancelled: nothing more is sent (ChunkScheduler)
        self.elsewhere = False  # its chunks are rendered by the second process (ChunkScheduler)
        # Its items handed to the vocoder thread and those sent, in turns: they are sent in the order they
        # were handed on, whichever thread vocodes them (ChunkScheduler).
        self.handed = 0
        self.sent_turns = 0

    def ready(self, inputs: Mapping[str, Any], final: bool) -> bool:
        """Whether the next chunk can be rendered from ``inputs`` (the talker's codes so far)."""
        return final or codes_in(inputs) >= self.plan.ready_at(self.start)

    def deadline(self) -> float:
        """When its listener runs out of audio (monotonic seconds): a stream that has sent nothing yet
        is due since it arrived; the audio of its chunks at the vocoder counts as sent."""
        start = self.arrived if self.first_sound is None else self.first_sound
        return start + self.seconds_out + self.seconds_queued

    def check(self) -> None:
        if self.job.cancelled:
            raise StageCancelled()

    def prepare(self) -> ChunkWork | None:
        """The next chunk's window (call when :meth:`ready`), or None when every code is rendered (an
        empty utterance: the caller then ends the stream with :meth:`finish`, after any chunk of it still
        at the vocoder)."""
        stage, job, plan = self.stage, self.job, self.plan
        inputs, final = self.feed.snapshot()
        codes = torch.as_tensor(inputs.get("codes", torch.zeros(0, dtype=torch.long))).reshape(1, -1)
        total = int(codes.shape[1])
        if self.start >= total:  # final: every code is rendered
            return None
        low, high = plan.window(self.start, total if final else None)
        end = min(plan.end(self.start, total if final else None), total)
        noise = self.noise.frames(low * plan.repeats, high * plan.repeats).to(stage.device)
        window_codes = codes[:, low:high]
        real = None
        if high > total:  # the last block's padding: code 0, masked out of the real frames' attention
            real = (total - low) * plan.repeats
            window_codes = torch.cat([window_codes, window_codes.new_zeros((1, high - total))], dim=1)
        window = stage.window(job, window_codes.to(stage.device), self.speaker, self.voice, noise, real)
        seconds = (end - self.start) * plan.repeats * plan.hop / stage.sample_rate / speed_of(job)
        return ChunkWork(window, low, self.start, end, final and end >= total, seconds)

    def advance(self, work: ChunkWork) -> None:
        """The chunk's mel is made: the stream's next chunk starts after it (its samples may still be at
        the vocoder: :meth:`deliver` sends them, in order)."""
        self.start = work.end
        self.seconds_queued += work.seconds

    def vocoder_input(self, work: ChunkWork, mel: torch.Tensor) -> torch.Tensor:
        """What the vocoder renders of the chunk's window ``mel`` (1, mels, frames): the chunk's frames and
        its reach either side, not the DiT's whole window (never the window's padding)."""
        low, high, _, _ = self.vocoder_span(work)
        return mel[:, :, low:high].contiguous()  # as the second process receives it

    def chunk_samples(self, work: ChunkWork, wave: torch.Tensor) -> torch.Tensor:
        """The chunk's own samples of ``wave``, the vocoder's samples (1-D) of :meth:`vocoder_input`."""
        low, _, first, last = self.vocoder_span(work)
        hop = self.plan.hop
        return wave[(first - low) * hop : (last - low) * hop].clone()

    def vocoder_span(self, work: ChunkWork) -> tuple[int, int, int, int]:
        plan = self.plan
        first, last = (work.start - work.low) * plan.repeats, (work.end - work.low) * plan.repeats
        low = max(0, first - VOCODER_REACH_FRAMES)
        high = min(work.window.real_frames, last + VOCODER_REACH_FRAMES)
        return low, high, first, last

    def vocode(self, work: ChunkWork, mel: torch.Tensor, vocoder: Vocoder | None = None) -> torch.Tensor:
        """The chunk's samples from its window's ``mel`` (1, mels, frames), by ``vocoder`` (else the
        stage's chunk vocoder in this process)."""
        render = self.stage.chunk_vocoder if vocoder is None else vocoder
        return self.chunk_samples(work, render(self.vocoder_input(work, mel))[0])

    def deliver(self, work: ChunkWork, samples: torch.Tensor) -> bool:
        """Send the chunk's ``samples`` (:meth:`vocode`; the chunks of a stream in order); True when the
        stream is finished."""
        stage, job = self.stage, self.job
        if self.tempo is not None:
            samples = torch.from_numpy(self.tempo.push(samples.numpy()))
        self.seconds_queued -= work.seconds
        self.send(samples)
        self.rendered += 1
        job.emit(
            DiffusionStep(
                job.request_id,
                job.index,
                stage.stage_id,
                step=self.rendered,
                total=self.rendered if work.last else 0,
            )
        )
        if work.last:
            self.finish()
        return work.last

    def step(self) -> bool:
        """Render the next chunk alone (call when :meth:`ready`); True when the stream is finished."""
        work = self.prepare()
        if work is None:
            self.finish()
            return True
        mel = self.stage.flow.integrate([work.window], self.check)
        self.advance(work)
        return self.deliver(work, self.vocode(work, mel))

    def finish(self) -> None:
        if self.tempo is not None:  # the stretcher's last samples (for an empty utterance: none)
            self.send(torch.from_numpy(self.tempo.finish()))
        elif not self.rendered:  # nothing to speak: an empty utterance, as a whole render gives
            self.send(torch.zeros(0, dtype=torch.float32))

    def send(self, samples: torch.Tensor) -> None:
        if samples.numel():
            if self.first_sound is None:
                self.first_sound = time.monotonic()
            self.seconds_out += samples.numel() / self.stage.sample_rate
        self.stage.send(self.job, samples)


Stream = tuple[StreamRender, JobDone]
# A chunk past the DiT, for the vocoder: its stream, the mel, or (None, None) for the stream's end once
# its earlier chunks are sent (a feed that ended on a chunk boundary).
VocoderItem = tuple[StreamRender, JobDone, ChunkWork | None, torch.Tensor | None]
# In the vocoder queue: (deadline, the order items were put, the item, its turn in its stream), or an
# item None (the end of the vocoder thread).
VocoderEntry = tuple[float, int, VocoderItem | None, int]


def _there(entry: VocoderEntry) -> bool:
    """Whether the entry is a chunk whose DiT window the second process integrates too (no mel yet)."""
    item = entry[2]
    return item is not None and item[2] is not None and item[3] is None


def _vocoded_in_one_call(
    chunks: Sequence[tuple[StreamRender, ChunkWork | None, torch.Tensor | None]], vocoder: Vocoder
) -> list[torch.Tensor]:
    """The samples of chunks past the DiT (their stream, the chunk, its window's mel; of one vocoder input
    length) from one ``vocoder`` call over all of them."""
    inputs, spans = [], []
    for render, work, mel in chunks:
        assert work is not None and mel is not None
        inputs.append(render.vocoder_input(work, mel))
        spans.append((render, work))
    waves = vocoder(torch.cat(inputs))
    return [render.chunk_samples(work, wave) for (render, work), wave in zip(spans, waves, strict=True)]


def _vocoder_frames(item: VocoderItem) -> int:
    """The length (mel frames) of a chunk's vocoder input."""
    render, _, work, mel = item
    assert work is not None and mel is not None
    low, high, _, _ = render.vocoder_span(work)
    return high - low


class ChunkScheduler:
    """Renders the chunks of every stream in flight. Its thread takes the most urgent ready chunk
    (earliest :meth:`StreamRender.deadline`; arrival order breaks ties), together with the other ready
    chunks whose windows have its length (one DiT batch, :class:`~engine.pipelines.qwen_omni.dit_batch.
    BatchedFlow`, where :func:`batch_holds` finds that a batch gives each window its alone bits on this
    machine; else one after another), and vocodes and sends them (those of one length in one vocoder call
    where :func:`~engine.pipelines.qwen_omni.bigvgan_cpu.batch_holds` finds, on this thread, that it gives
    each its alone samples: docs/speech.md, "One core"). Where the machine has a second core
    for a small model, a second process (:class:`~engine.pipelines.qwen_omni.code2wav_process.
    Code2WavProcess`, checked to give this process's bits) renders the chunks' samples instead, and every
    other stream's chunks end to end (DiT and vocoder), fed by a vocoder thread the most urgent first
    (with the other waiting chunks that can share its call: a stream's chunks in order), while this thread
    integrates the next batch of the others; it renders waiting chunks itself when it has nothing to
    integrate while the process is busy (each stream's chunks still sent in turn; docs/speech.md, "The
    second process"). A stream joins as soon as the stage worker hands it over and leaves when finished,
    failed or cancelled; a failure is its own (the others go on)."""

    def __init__(self, stage: Code2WavStage) -> None:
        self.stage = stage
        self.max_batch = int(stage.stage.engine_args.max_num_seqs or 1)
        self.batching: dict[tuple[int, bool], bool] = {}  # (frames, guided) -> batch_holds, on this thread
        self.batch_sizes: Counter[int] = Counter()  # DiT batches rendered, by windows per batch
        self._inbox: queue.SimpleQueue[tuple[StageJob, JobDone] | None] = queue.SimpleQueue()
        self._wake = threading.Event()  # set by a feed's publication or close, and by a new arrival
        # (deadline, order, item): a stream's chunks have rising deadlines, so they leave in order
        self._vocoder_queue: queue.PriorityQueue[VocoderEntry] = queue.PriorityQueue()
        self._queued = 0  # the vocoder queue's tie-break: the order items were put
        self._turns = threading.Condition()  # a stream's items are sent in turn (StreamRender.handed)
        self._vocoder_busy = False  # the vocoder thread is sending an item
        self.vocoded_here = 0  # chunks the scheduler's thread vocoded while the second process was busy
        self.rendered_there = 0  # chunks the second process rendered end to end (DiT and vocoder)
        self._admitted = 0  # streams admitted since the second process is up
        self._ends = threading.Lock()  # a stream ends once, and nothing is sent for it after
        self._remote: Code2WavProcess | None = None  # the second process, once started and checked
        self._handing_over = False  # set once it is: every chunk goes through the vocoder thread from then
        self._closed = threading.Event()
        # One core (no second process): this thread vocodes a DiT batch's chunks of one length in one call
        # where vocoder_batch_holds finds, on this thread, that a batch gives each its alone samples; the
        # lengths most chunks have are checked while the thread is idle (docs/speech.md, "One core").
        self.vocoder_batching: dict[int, bool] = {}  # chunk frames -> whether a batch holds here
        self.vocoder_batch_sizes: Counter[int] = Counter()  # in-process vocoder calls, by chunks per call
        # The two chunk lengths most chunks have (ChunkPlan.vocoder_frames), and those still to check here.
        self._usual_lengths = ChunkPlan.of(
            stage.model, int(stage.stage.engine_args.chunk_size or 1)
        ).vocoder_frames()
        self._vocoder_checks = [] if self._second_core() else list(self._usual_lengths)
        name = f"omni-code2wav-{stage.stage_id}"
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._vocoder = threading.Thread(target=self._vocode, name=f"{name}-vocoder", daemon=True)
        self._vocoder.start()
        self._thread.start()
        self._remote_wanted = self._second_core()  # started when a second stream is in flight
        self._starter: threading.Thread | None = None  # the thread starting it

    def _want_remote(self) -> None:
        if self._remote_wanted:
            self._remote_wanted = False
            name = f"omni-code2wav-{self.stage.stage_id}-start"
            self._starter = threading.Thread(target=self._start_remote, name=name, daemon=True)
            self._starter.start()

    def _second_core(self) -> bool:
        """Whether a second process may pay: a CPU stage whose model runs on one thread, on a machine
        with more than one core for this process (it is started once two streams are in flight)."""
        if self.stage.device.type != "cpu" or self.stage.intra_op_threads != 1:
            return False
        return len(os.sched_getaffinity(0)) >= 2 if hasattr(os, "sched_getaffinity") else False

    def _start_remote(self) -> None:
        self._remote_wanted = False  # once (a caller may start it before two streams are in flight)
        self._threads()
        stage = self.stage
        with torch.inference_mode():
            remote = Code2WavProcess.start(
                stage.model_path,
                1,
                stage.chunk_vocoder,
                stage.flow,
                self._usual_lengths,
                VOCODER_BATCH,
                self.max_batch,
            )
        if remote is None:
            return
        if self._closed.is_set():
            remote.close()
            return
        self._remote = remote
        self._handing_over = True

    def submit(self, job: StageJob, done: JobDone) -> None:
        self._inbox.put((job, done))
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._wake.set()
        self._thread.join(timeout=30)
        self._vocoder.join(timeout=30)
        if self._starter is not None:  # a process still starting: it sees the close and stops it
            self._starter.join(timeout=30)
        remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    def _threads(self) -> None:
        threads = self.stage.intra_op_threads
        if threads is not None:
            torch.set_num_threads(threads)  # this thread's setting only

    def _loop(self) -> None:
        self._threads()
        streams: dict[int, Stream] = {}
        order = 0  # arrival order, the tie-break
        arrival: dict[int, int] = {}
        try:
            with torch.inference_mode():
                while True:
                    while True:
                        try:
                            item = self._inbox.get_nowait()
                        except queue.Empty:
                            if streams:
                                break
                            if self._vocode_here():  # nothing to integrate: help a busy vocoder
                                continue
                            if self._check_vocoder_length():  # idle: one length's batch check
                                continue
                            try:  # idle: wait for a stream (now and then helping the vocoder)
                                backlog = not self._vocoder_queue.empty()
                                item = (
                                    self._inbox.get(timeout=CANCEL_POLL_S) if backlog else self._inbox.get()
                                )
                            except queue.Empty:
                                continue
                        if item is None:
                            for render, done in streams.values():
                                self._end(render, done, StageCancelled())
                            return
                        job, done = item
                        admitted = self._admit(job, done)
                        if admitted is not None and self._remote is not None:
                            admitted.elsewhere = self._renders_there()
                        if admitted is not None:
                            key = id(job)
                            streams[key], arrival[key] = (admitted, done), order
                            order += 1
                            if len(streams) > 1:
                                self._want_remote()
                    for key, (render, done) in list(streams.items()):
                        if render.job.cancelled or render.ended:  # ended: failed at the vocoder
                            del streams[key]
                            self._end(render, done, StageCancelled())
                    self._wake.clear()  # a publication from here on wakes the wait below
                    due = sorted(
                        (render.deadline(), arrival[key], key)
                        for key, (render, _) in streams.items()
                        if render.ready(*render.feed.snapshot())
                    )
                    if not due:
                        if not self._vocode_here():
                            self._wake.wait(CANCEL_POLL_S)
                        continue
                    self._render([key for _, _, key in due], streams)
        finally:
            self._to_vocoder(math.inf, None)  # the vocoder sends what it has, then stops

    def _render(self, due: list[int], streams: dict[int, Stream]) -> None:
        """Integrate the most urgent ready chunk (``due[0]``) and, in one batch with it, the other ready
        chunks whose windows match it (up to ``max_num_seqs``); hand their mels to the vocoder."""
        works: list[tuple[int, ChunkWork]] = []
        for key in due:
            render, done = streams[key]
            try:
                work = render.prepare()
            except Exception as exc:  # this stream fails; the others go on
                del streams[key]
                self._end(render, done, exc)
                continue
            if work is None:  # every code is rendered: it ends once its chunks at the vocoder are sent
                del streams[key]
                self._hand_on(render.deadline(), (render, done, None, None))
                continue
            if works and not self._joins(works[0], (key, work), streams):
                continue  # prepared again next time: preparing has no effect on the stream
            works.append((key, work))
            if len(works) == self.max_batch:
                break
        if not works:
            return
        if streams[works[0][0]][0].elsewhere and self._remote is not None:
            for key, work in works:  # to the second process, through the vocoder thread's queue
                render, done = streams[key]
                deadline = render.deadline()
                render.advance(work)
                if work.last:
                    del streams[key]
                self._to_vocoder(deadline, (render, done, work, None))
            return
        self.batch_sizes[len(works)] += 1
        try:
            mels = self.stage.flow.integrate([work.window for _, work in works])
        except Exception:  # rendered alone, so a failure is the stream's own
            mels = None
        here: list[tuple[int, VocoderItem]] = []  # chunks to vocode and send on this thread
        for row, (key, work) in enumerate(works):
            render, done = streams[key]
            try:
                mel = (
                    mels[row : row + 1]
                    if mels is not None
                    else self.stage.flow.integrate([work.window], render.check)
                )
            except Exception as exc:
                del streams[key]
                self._end(render, done, exc)
                continue
            deadline = render.deadline()
            render.advance(work)
            if work.last:  # nothing more to integrate: the vocoder ends it
                del streams[key]
            if self._handing_over:
                self._to_vocoder(deadline, (render, done, work, mel))
            else:
                here.append((key, (render, done, work, mel)))
        samples = self._vocoded_here_together([item for _, item in here])
        for index, (key, item) in enumerate(here):
            self._send(item, None, None, samples.get(index))
            if item[0].ended:
                streams.pop(key, None)

    def _vocoded_here_together(self, items: list[VocoderItem]) -> dict[int, torch.Tensor]:
        """The samples of ``items`` (chunks past the DiT, vocoded on this thread) that share a vocoder call
        with others of their length (up to VOCODER_BATCH a call) where the check found that it holds here,
        by their index; the others are vocoded one by one when sent. A failing batch leaves its chunks to
        be vocoded alone (a failure is then a stream's own)."""
        lengths: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            frames = _vocoder_frames(item)
            if self.vocoder_batching.get(frames):
                lengths.setdefault(frames, []).append(index)
        samples: dict[int, torch.Tensor] = {}
        for indices in lengths.values():
            for start in range(0, len(indices), VOCODER_BATCH):
                group = indices[start : start + VOCODER_BATCH]
                if len(group) < 2:
                    continue
                chunks = [(items[i][0], items[i][2], items[i][3]) for i in group]
                try:
                    together = _vocoded_in_one_call(chunks, self.stage.chunk_vocoder)
                except Exception:  # noqa: BLE001  # each is vocoded alone when sent
                    continue
                self.vocoder_batch_sizes[len(group)] += 1
                samples.update(zip(group, together, strict=True))
        return samples

    def _check_vocoder_length(self) -> bool:
        """Check one pending chunk length for in-process vocoder batches (one core); True when it ran."""
        if not self._vocoder_checks:
            return False
        frames = self._vocoder_checks.pop(0)
        mels = int(self.stage.model.code2wav_dit_model.mel_dim)
        self.vocoder_batching[frames] = vocoder_batch_holds(
            self.stage.chunk_vocoder, mels, frames, VOCODER_BATCH
        )
        return True

    def _renders_there(self) -> bool:
        """Whether a stream admitted now is rendered by the second process: every other one (docs/speech.md,
        "The second process")."""
        self._admitted += 1
        return self._admitted % 2 == 0

    def _joins(
        self, first: tuple[int, ChunkWork], other: tuple[int, ChunkWork], streams: dict[int, Stream]
    ) -> bool:
        """Whether ``other`` (a stream's key and chunk) may share a DiT batch with ``first``, the most
        urgent chunk: the same window key, the same process, and in this one a length that batches here
        (the second process checks its own)."""
        (first_key, first_work), (key, work) = first, other
        elsewhere = streams[first_key][0].elsewhere
        if work.window.key != first_work.window.key or streams[key][0].elsewhere != elsewhere:
            return False
        return (elsewhere and self._remote is not None) or self._batches(work)

    def _hand_on(self, deadline: float, item: VocoderItem) -> None:
        """Give a stream's end to the vocoder thread (after its chunks there), or, before there is a
        second process, end it here."""
        if self._handing_over:
            self._to_vocoder(deadline, item)
        else:
            self._send(item, None)

    def _to_vocoder(self, deadline: float, item: VocoderItem | None) -> None:
        turn = -1
        if item is not None:
            turn, item[0].handed = item[0].handed, item[0].handed + 1
        self._queued += 1
        self._vocoder_queue.put((deadline, self._queued, item, turn))

    def _vocode_here(self) -> bool:
        """With no chunk to integrate while the second process is busy, render the most urgent chunk
        waiting for it on this thread (docs/speech.md, "The second process"): its mel (or, for a chunk
        the process was to render end to end, its DiT window and then its mel) by this process's models,
        which give the process's bits (checked when the process started). It is the most urgent of its
        stream still queued (a stream's chunks have rising deadlines), and it is sent in its turn, after
        any earlier chunk of its stream at the process. True when it rendered one."""
        if not self._handing_over or not self._vocoder_busy:
            return False
        try:
            entry = self._vocoder_queue.get_nowait()
        except queue.Empty:
            return False
        _, _, item, turn = entry
        if item is None or item[2] is None:  # the thread's end, or a stream's: the vocoder thread's
            self._vocoder_queue.put(entry)  # its place kept: the same deadline and order
            return False
        self.vocoded_here += 1
        self._send(item, None, turn)
        return True

    def _vocode(self) -> None:
        """The vocoder thread: the chunks' samples from the second process, sent, the most urgent first,
        each with the other waiting chunks it can share a call with (:meth:`_companions`). If the process
        fails, the chunks are rendered here from then on."""
        self._threads()
        with torch.inference_mode():
            while True:
                entry = self._vocoder_queue.get()
                if entry[2] is None:
                    return
                self._vocoder_busy = True
                try:
                    self._send_batch([entry, *self._companions(entry)], self._remote)
                finally:
                    self._vocoder_busy = False

    def _companions(self, first: VocoderEntry) -> list[VocoderEntry]:
        """The most urgent other chunks waiting in the vocoder queue that share ``first``'s call to the
        second process (taken out of the queue): for a chunk it renders end to end, those with its DiT
        window's key (up to ``max_num_seqs`` in all); for a mel to vocode, those of its length where the
        process batches that length (up to VOCODER_BATCH). A chunk whose stream has an earlier item left
        in the queue stays there too: it could not be sent before that one, which nothing would render
        while this thread waits."""
        remote, item = self._remote, first[2]
        if remote is None or item is None or item[2] is None:
            return []
        window_key = item[2].window.key
        there = item[3] is None  # DiT and vocoder there
        if not there and _vocoder_frames(item) not in remote.batch_frames:
            return []
        limit = self.max_batch if there else VOCODER_BATCH

        def joins(other: VocoderItem) -> bool:
            if other[2] is None or (other[3] is None) != there:
                return False
            if there:
                return other[2].window.key == window_key
            return _vocoder_frames(other) == _vocoder_frames(item)

        taken: list[VocoderEntry] = []
        kept: list[VocoderEntry] = []
        waiting: set[int] = set()  # streams with an item kept in the queue
        while len(taken) < limit - 1:
            try:
                entry = self._vocoder_queue.get_nowait()
            except queue.Empty:
                break
            other = entry[2]
            if other is None or id(other[0]) in waiting or not joins(other):
                kept.append(entry)
                if other is not None:
                    waiting.add(id(other[0]))
            else:
                taken.append(entry)
        for entry in kept:
            self._vocoder_queue.put(entry)  # its place kept: the same deadline and order
        return taken

    def _send_batch(self, entries: list[VocoderEntry], remote: Code2WavProcess | None) -> None:
        """Render the chunks of ``entries`` (several: in one call to ``remote``) and send each in its
        stream's turn, in the entries' order (a stream's chunks have rising deadlines)."""
        samples = None
        if remote is not None and _there(entries[0]):
            samples = self._rendered_there(entries, remote)
        elif remote is not None and len(entries) > 1:
            samples = self._vocoded_together(entries, remote)
        for index, (_, _, item, turn) in enumerate(entries):
            assert item is not None
            self._send(item, self._remote, turn, None if samples is None else samples[index])

    def _chunks_of(
        self, entries: list[VocoderEntry]
    ) -> list[tuple[StreamRender, ChunkWork, torch.Tensor | None]]:
        chunks = []
        for _, _, item, _ in entries:
            assert item is not None and item[2] is not None
            chunks.append((item[0], item[2], item[3]))
        return chunks

    def _rendered_there(
        self, entries: list[VocoderEntry], remote: Code2WavProcess
    ) -> list[torch.Tensor] | None:
        """The chunks' samples rendered end to end by the second process in one call, or None if it failed
        (then each is rendered in this process, from now on)."""
        chunks = self._chunks_of(entries)
        spans = [render.vocoder_span(work)[:2] for render, work, _ in chunks]
        try:
            waves = remote.render_chunks([work.window for _, work, _ in chunks], spans)
        except (RuntimeError, OSError, EOFError):
            self._drop(remote)
            return None
        self.rendered_there += len(chunks)
        return [
            render.chunk_samples(work, wave) for (render, work, _), wave in zip(chunks, waves, strict=True)
        ]

    def _vocoded_together(
        self, entries: list[VocoderEntry], remote: Code2WavProcess
    ) -> list[torch.Tensor] | None:
        """The chunks' samples from one call to the second process, or None if it failed (then each is
        vocoded in this process, from now on)."""
        try:
            return _vocoded_in_one_call(self._chunks_of(entries), remote.render)
        except (RuntimeError, OSError, EOFError):
            self._drop(remote)
            return None

    def _drop(self, remote: Code2WavProcess) -> None:
        """The second process failed: everything is rendered in this process from now on."""
        if self._remote is remote:
            self._remote = None
        remote.close()

    def _send(
        self,
        item: VocoderItem,
        remote: Code2WavProcess | None,
        turn: int | None = None,
        samples: torch.Tensor | None = None,
    ) -> None:
        """Vocode a chunk (by ``remote``, else in this process; ``samples``: vocoded already) and send it,
        or end a stream whose chunks are all sent; a stream that has ended meanwhile sends nothing.
        ``turn``: the item's place among its stream's items handed to the vocoder thread (it is sent after
        those before it)."""
        try:
            self._vocode_and_send(item, remote, turn, samples)
        finally:
            if turn is not None:
                with self._turns:
                    item[0].sent_turns += 1
                    self._turns.notify_all()

    def _vocode_and_send(
        self,
        item: VocoderItem,
        remote: Code2WavProcess | None,
        turn: int | None,
        samples: torch.Tensor | None,
    ) -> None:
        render, done, work, mel = item
        if render.ended:
            return
        try:
            render.check()  # a stream cancelled since sends nothing more
            if samples is None and work is not None:
                if mel is None:  # meant for the second process, rendered here (it failed, or was busy)
                    mel = self.stage.flow.integrate([work.window], render.check)
                samples = self._vocoded(render, work, mel, remote)
            if turn is not None:
                with self._turns:  # the stream's earlier items first (vocoded by the other thread)
                    while render.sent_turns < turn and not render.ended:
                        self._turns.wait(CANCEL_POLL_S)
            with self._ends:
                if render.ended:
                    return
                finished = True
                if work is None or samples is None:
                    render.finish()
                else:
                    finished = render.deliver(work, samples)
        except Exception as exc:
            self._end(render, done, exc)
            return
        if finished:
            self._end(render, done, None)

    def _vocoded(
        self, render: StreamRender, work: ChunkWork, mel: torch.Tensor, remote: Code2WavProcess | None
    ) -> torch.Tensor:
        if remote is not None:
            try:
                return render.vocode(work, mel, remote.render)
            except (RuntimeError, OSError, EOFError):  # the process failed: vocode here from now on
                self._drop(remote)
        return render.vocode(work, mel)

    def _batches(self, work: ChunkWork) -> bool:
        """Whether windows of this one's length may share a DiT batch on this machine (checked once)."""
        window = work.window
        key = (window.frames, window.cfg)
        if key not in self.batching:
            self.batching[key] = batch_holds(self.stage.flow, window.frames, window.cfg, self.max_batch)
        return self.batching[key]

    def _end(self, render: StreamRender, done: JobDone, error: Exception | None) -> None:
        """The stream is finished (``error`` None), cancelled or failed: its ``done``, once."""
        with self._ends:
            if render.ended:
                return
            render.ended = True
        if error is None:
            done(StageStatus.SUCCEEDED, None)
        elif isinstance(error, StageCancelled):
            done(StageStatus.CANCELLED, None)
        else:
            done(StageStatus.FAILED, error)

    def _admit(self, job: StageJob, done: JobDone) -> StreamRender | None:
        try:
            if job.cancelled:
                raise StageCancelled()
            feed = job.inputs.get(CHUNK_FEED_KEY)
            if feed is None:  # handed whole (its source published nothing): rendered at once
                self.stage.run([job])
                done(StageStatus.CANCELLED if job.cancelled else StageStatus.SUCCEEDED, None)
                return None
            feed.subscribe(self._wake)
            return StreamRender(self.stage, job, feed)
        except StageCancelled:
            done(StageStatus.CANCELLED, None)
        except Exception as exc:
            done(StageStatus.FAILED, exc)
        return None
