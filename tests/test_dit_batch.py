"""code2wav's DiT over a batch of windows (engine/pipelines/qwen_omni/dit_batch.py, docs/speech.md "Many
listeners"): alone it is the library's forward bit for bit; batched, every window keeps its alone bits
where the running machine's check says so, and the check catches a batch that does not."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import GenerationParams, GenerationRequest
from engine.engine import OmniEngine, build_engine
from engine.modality import OutputAccumulator, OutputModality
from engine.pipelines.qwen_omni import code2wav_streams, dit_batch
from engine.pipelines.qwen_omni.code2wav_process import Code2WavProcess
from engine.pipelines.qwen_omni.dit_batch import BatchedFlow, batch_holds
from engine.stages.base import StageJob
from engine.streaming import CHUNK_FEED_KEY, ChunkFeed
from tests.conftest import tiny_deploy

CHUNK = 12
DEADLINE_S = 300  # bounds a hang only


@pytest.fixture(scope="module")
def engine(session_data_dir) -> Iterator[OmniEngine]:
    built = build_engine(
        "tiny-qwen-omni",
        tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": CHUNK}),
        data_dir=session_data_dir,
    )
    yield built
    built.close()


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # code2wav's intra-op threads: the kernels it runs
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def _voice(engine: OmniEngine, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    speaker = engine.runners[2].speakers[name]
    return speaker["cond"].float(), speaker["ref_mel"].float()


def _windows(
    engine: OmniEngine,
    count: int,
    codes: int,
    guidance: float = 0.5,
    steps: int = 4,
    real: tuple[int | None, ...] = (),
):
    """``count`` random windows of ``codes`` codes; window i padded after ``real[i]`` frames if given."""
    flow: BatchedFlow = engine.runners[2].flow
    generator = torch.Generator().manual_seed(7)
    windows = []
    for i in range(count):
        speaker, reference = _voice(engine, "Ethan" if i % 2 else "Chelsie")
        ids = torch.randint(0, 100, (1, codes), generator=generator)
        noise = torch.randn((1, codes * 2, 80), generator=generator)
        voice = flow.voice(reference, guidance >= 1e-5)
        padded_from = real[i] if i < len(real) else None
        windows.append(flow.window(ids, speaker, voice, noise, guidance, steps, padded_from))
    return flow, windows


@pytest.mark.parametrize("guidance", [0.5, 0.0])
def test_a_window_alone_is_the_library_forward_bit_for_bit(engine, one_thread, guidance):
    flow, (window,) = _windows(engine, 1, 36, guidance)
    dit = flow.dit
    speaker, reference = _voice(engine, "Chelsie")
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 100, (1, 36), generator=generator)
    state = window.start
    time = torch.tensor(0.37)
    common = {
        "hidden_states": state,
        "speaker_embedding": speaker.unsqueeze(1).repeat(1, state.shape[1], 1),
        "condition_vector": reference,
        "quantized_code": codes,
        "time_step": time,
    }
    if guidance:
        guided, unguided = torch.chunk(dit(**common, apply_cfg=True), 2, dim=0)
        library = guided + (guided - unguided) * guidance
    else:
        library = dit(**common, drop_audio_conditioning=False, drop_code=False, apply_cfg=False)
    assert torch.equal(flow.velocity([window])(time, state), library)


def test_a_batch_gives_every_window_its_alone_mel_where_the_check_holds(engine, one_thread):
    flow, windows = _windows(engine, 4, 36, real=(None, 50, None, 13))  # two end in padding
    holds = batch_holds(flow, 72, True, 8)
    alone = [flow.integrate([w]) for w in windows]
    together = flow.integrate(windows)
    same = [torch.equal(together[i : i + 1], alone[i]) for i in range(4)]
    if holds:  # the check's verdict is what the scheduler relies on
        assert all(same), same
    # Batched or not, the mel is the same to float rounding.
    assert max(float((together[i : i + 1] - alone[i]).abs().max()) for i in range(4)) < 1e-4


def test_the_check_refuses_a_batch_that_changes_a_window(engine, one_thread, monkeypatch):
    flow = BatchedFlow(engine.runners[2].flow.dit)
    original = flow.forward

    def drifting(time, state, condition, cfg, real=None):  # a kernel whose bits depend on the row count
        out = original(time, state, condition, cfg, real)
        return out + (state.shape[0] - 1) * 1e-7

    monkeypatch.setattr(flow, "forward", drifting)
    assert not batch_holds(flow, 48, True, 4)


def test_kept_time_points_give_later_windows_the_bits_of_a_fresh_flow(engine, one_thread, monkeypatch):
    """The modulations made at a time point are kept for the next windows on the same grid (and dropped,
    all at once, past TIME_ROWS_KEPT): a window rendered after others gets the mel a fresh flow gives it."""
    flow, windows = _windows(engine, 3, 36, steps=4)
    fresh = [BatchedFlow(flow.dit).integrate([w]) for w in windows]
    flow = BatchedFlow(flow.dit)
    assert torch.equal(flow.integrate(windows[:1]), fresh[0])
    kept = len(flow._times)
    assert kept >= 4  # the grid's points and the RK4 stages between them
    assert torch.equal(flow.integrate(windows[1:2]), fresh[1])  # every time point kept: made once
    assert len(flow._times) == kept
    monkeypatch.setattr(dit_batch, "TIME_ROWS_KEPT", 3)
    bounded = BatchedFlow(flow.dit)
    for window, mel in zip(windows, fresh, strict=True):
        assert torch.equal(bounded.integrate([window]), mel)
        assert len(bounded._times) <= 3


def test_batches_of_one_length_and_other_sizes_each_get_their_own_masks(engine, one_thread):
    """The masks are made once per batch shape: a window alone, then four, three and alone again (the
    whole render batches requests of one length too) each run, and alone gives the same mel each time."""
    flow, windows = _windows(engine, 4, 36, steps=2)
    flow = BatchedFlow(flow.dit)  # nothing made yet
    alone = flow.integrate(windows[:1])
    assert flow.integrate(windows).shape[0] == 4
    assert flow.integrate(windows[:3]).shape[0] == 3
    assert torch.equal(flow.integrate(windows[:1]), alone)
    _, padded = _windows(engine, 2, 36, steps=2, real=(None, 50))
    assert flow.integrate(padded).shape[0] == 2


@pytest.mark.parametrize("real_codes", [30, 25, 13])
def test_a_padded_window_renders_its_real_frames_as_the_window_without_padding(
    engine, one_thread, real_codes
):
    """A last chunk's window padded to its block's end: the padding is masked out of the real frames'
    attention, so their mel is the unpadded window's to float rounding, and never NaN; a padding that
    leaked (no mask) moves them 40x more in this tiny model."""
    flow, (padded,) = _windows(engine, 1, 36, real=(real_codes * 2,))
    frames = real_codes * 2
    speaker, reference = _voice(engine, "Chelsie")
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 100, (1, 36), generator=generator)[:, :real_codes]
    voice = flow.voice(reference, True)
    unpadded = flow.window(ids, speaker, voice, padded.start[:, :frames], 0.5, 4)
    real = flow.integrate([padded])[:, :, :frames]
    assert torch.isfinite(real).all()
    alone = flow.integrate([unpadded])
    assert float((real - alone).abs().max()) < 1e-6  # rounding (measured: up to 2.4e-7)
    leaked = flow.window(ids.new_zeros(1, 36), speaker, voice, padded.start, 0.5, 4)
    leaked.condition[:, :frames] = padded.condition[:, :frames]  # the same window, padding unmasked
    assert float((flow.integrate([leaked])[:, :, :frames] - alone).abs().max()) > 5e-6  # 1e-5 to 3e-5


def test_the_last_window_stops_at_the_end_of_its_last_codes_block(engine):
    plan = code2wav_streams.ChunkPlan.of(engine.runners[2].model, 24)
    assert plan.block == 12 and (plan.back, plan.ahead) == (12, 12)
    assert plan.window(0, None) == (0, 36)  # the talker still speaking: the whole window
    assert plan.window(0, 30) == (0, 36)  # 30 codes: padded to the block's end
    assert plan.window(0, 13) == (0, 24)
    assert plan.window(0, 24) == (0, 24)  # ends on a block: no padding
    assert plan.window(24, 40) == (12, 48)
    assert plan.window(24, 200) == (12, 84)  # the end far away: the whole window


def _submit_streams(engine: OmniEngine, count: int) -> list[StageJob]:
    """``count`` code2wav streams, every code known, handed to the stage at once."""
    runner = engine.runners[2]
    generator = torch.Generator().manual_seed(3)
    jobs: list[StageJob] = []
    finished: dict[int, threading.Event] = {}
    for i in range(count):
        codes = torch.randint(0, 100, (1, 3 * CHUNK + 5), generator=generator)
        feed = ChunkFeed()
        feed.publish({"codes": codes}, final=True)
        resolved = engine.resolve(GenerationRequest("say hello", GenerationParams(seed=40 + i)))
        params = {**resolved.stage_params[2], "seed": 40 + i, "voice": "Ethan" if i % 2 else "Chelsie"}
        job = StageJob(
            "batch",
            i,
            {CHUNK_FEED_KEY: feed},
            params,
            lambda event: None,
            OutputAccumulator((OutputModality.AUDIO,)),
        )
        jobs.append(job)
    for job in jobs:
        finished[job.index] = threading.Event()
        runner.submit(job, lambda status, error, index=job.index: finished[index].set())
    assert all(event.wait(DEADLINE_S) for event in finished.values())
    return jobs


def _alone(engine: OmniEngine, job: StageJob) -> np.ndarray:
    runner = engine.runners[2]
    feed = ChunkFeed()
    feed.publish(job.inputs[CHUNK_FEED_KEY].snapshot()[0], final=True)
    alone = StageJob(
        "alone",
        0,
        {CHUNK_FEED_KEY: feed},
        dict(job.params),
        lambda event: None,
        OutputAccumulator((OutputModality.AUDIO,)),
    )
    before = torch.get_num_threads()
    torch.set_num_threads(runner.intra_op_threads or before)  # the stage's: the same kernels
    try:
        with torch.inference_mode():
            runner.stream(alone, feed)
    finally:
        torch.set_num_threads(before)
    return alone.deliver_outputs()["audio"].numpy()


def _scheduler(engine: OmniEngine) -> code2wav_streams.ChunkScheduler:
    scheduler = engine.runners[2]._scheduler
    assert scheduler is not None
    return scheduler


def test_eight_streams_share_dit_batches_and_each_keeps_its_alone_samples(engine):
    runner = engine.runners[2]
    if runner._scheduler is not None:
        runner._scheduler.batch_sizes.clear()
    jobs = _submit_streams(engine, 8)
    scheduler = _scheduler(engine)
    if any(scheduler.batching.values()):  # this machine's kernels hold: the chunks were batched
        assert max(scheduler.batch_sizes) > 1, scheduler.batch_sizes
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index


def test_where_the_check_fails_the_chunks_render_alone_with_the_same_samples(engine, monkeypatch):
    monkeypatch.setattr(code2wav_streams, "batch_holds", lambda *args, **kwargs: False)
    runner = engine.runners[2]
    if runner._scheduler is not None:
        runner._scheduler.batching.clear()
        runner._scheduler.batch_sizes.clear()
    jobs = _submit_streams(engine, 4)
    scheduler = _scheduler(engine)
    assert set(scheduler.batch_sizes) == {1} and not any(scheduler.batching.values())
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index
    scheduler.batching.clear()  # the next test checks again


@pytest.mark.parametrize("holds", [True, False])
def test_on_one_core_chunks_of_one_length_are_vocoded_together_with_their_alone_samples(
    engine, monkeypatch, holds
):
    """Without a second process (docs/speech.md, "One core") the scheduler's thread vocodes a DiT batch's
    chunks of one length in one call where its own check holds (the lengths most chunks have, checked while
    it is idle); where the check fails, one by one. Either way every stream equals its alone samples."""
    runner = engine.runners[2]
    _submit_streams(engine, 1)  # the stage's own scheduler exists
    own = runner._scheduler
    monkeypatch.setattr(code2wav_streams.ChunkScheduler, "_second_core", lambda self: False)
    if not holds:
        monkeypatch.setattr(code2wav_streams, "vocoder_batch_holds", lambda *args, **kwargs: False)
    one_core = code2wav_streams.ChunkScheduler(runner)
    runner._scheduler = one_core
    try:
        lengths = set(code2wav_streams.ChunkPlan.of(runner.model, CHUNK).vocoder_frames())
        deadline = time.monotonic() + DEADLINE_S
        while set(one_core.vocoder_batching) != lengths and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(one_core.vocoder_batching) == lengths  # checked while it had no stream
        jobs = _submit_streams(engine, 8)
        assert one_core._remote is None and one_core.vocoded_here == 0
        if any(one_core.vocoder_batching.values()):  # this machine's kernels hold: chunks went together
            assert max(one_core.vocoder_batch_sizes) > 1, one_core.vocoder_batch_sizes
        else:
            assert not one_core.vocoder_batch_sizes
        for job in jobs:
            assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index
    finally:
        runner._scheduler = own
        one_core.close()


def _with_second_process(engine: OmniEngine) -> tuple[code2wav_streams.ChunkScheduler, Code2WavProcess]:
    """The stage's scheduler and its second process, started here if it is not running."""
    _submit_streams(engine, 1)  # the scheduler exists
    scheduler = _scheduler(engine)
    if scheduler._starter is not None:  # started by an earlier test's concurrent streams
        scheduler._starter.join()
    if scheduler._remote is None:  # a one-core machine never starts it, a dead one is gone: start it here
        before = torch.get_num_threads()
        try:
            scheduler._start_remote()
        finally:
            torch.set_num_threads(before)
    remote = scheduler._remote
    assert remote is not None and scheduler._handing_over
    return scheduler, remote


def test_chunks_vocoded_by_the_code2wav_process_keep_their_alone_samples_and_outlive_its_failure(engine):
    """With the second process (docs/speech.md, "The second process") the chunks' samples are
    the alone render's, made in this process; when the process dies, the next chunk is vocoded here and
    every stream still equals its alone samples."""
    scheduler, remote = _with_second_process(engine)
    frames: list[int] = []
    render = remote.render
    remote.render = lambda mels: frames.extend([int(mels.shape[-1])] * len(mels)) or render(mels)  # type: ignore[method-assign]
    here, there = scheduler.vocoded_here, scheduler.rendered_there
    jobs = _submit_streams(engine, 4)
    # Every chunk of the four streams went to the process (its mel alone, or in a batch of one length, or
    # rendered there end to end: every other stream), but those the scheduler's thread took while the
    # process was busy and it had nothing to integrate.
    assert len(frames) + scheduler.rendered_there - there + scheduler.vocoded_here - here >= 8
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index
    remote._child.kill()
    remote._child.wait()
    jobs = _submit_streams(engine, 4)
    assert scheduler._remote is None  # it failed: the chunks are vocoded in this process from then on
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index


def test_streams_rendered_by_the_second_process_end_to_end_keep_their_alone_samples(engine, monkeypatch):
    """Every other stream's chunks are rendered by the second process, DiT and vocoder (docs/speech.md,
    "The second process"): here every stream is, and each equals its alone samples made in this process."""
    scheduler, _ = _with_second_process(engine)
    monkeypatch.setattr(scheduler, "_renders_there", lambda: True)
    there = scheduler.rendered_there
    jobs = _submit_streams(engine, 4)
    assert scheduler.rendered_there - there >= 1
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index


def test_while_the_code2wav_process_is_busy_the_scheduler_vocodes_and_every_stream_keeps_its_order(engine):
    """With nothing to integrate, the scheduler's thread vocodes chunks waiting for a busy second process
    (docs/speech.md, "The second process"), one stream's chunks still in order: a slow
    process leaves it most of them, and every stream equals its alone samples."""
    scheduler, remote = _with_second_process(engine)
    render = remote.render
    batches: list[int] = []

    def slow(mels: torch.Tensor) -> torch.Tensor:
        batches.append(len(mels))
        time.sleep(0.3)
        return render(mels)

    remote.render = slow  # type: ignore[method-assign]
    here = scheduler.vocoded_here
    try:
        jobs = _submit_streams(engine, 6)  # two chunks each
    finally:
        remote.render = render  # type: ignore[method-assign]
    assert scheduler.vocoded_here - here >= 4
    # The six first chunks have one length: the process renders several of them in one call where its
    # check finds that a batch keeps each chunk's alone bits (docs/speech.md, "BigVGAN on the CPU").
    assert max(batches) > 1 if remote.batch_frames else max(batches) == 1
    for job in jobs:
        assert np.array_equal(job.deliver_outputs()["audio"].numpy(), _alone(engine, job)), job.index


class _Stream:
    """A stream in the vocoder queue, for the choice of a call's chunks alone."""

    def vocoder_span(self, work: SimpleNamespace) -> tuple[int, int, int, int]:
        return 0, work.frames, 0, work.frames


def test_a_call_to_the_second_process_takes_chunks_that_match_but_never_one_behind_its_streams_earlier_chunk():
    """The vocoder thread sends the most urgent chunk with other waiting chunks it can share a call with:
    mels of its length (up to four), or chunks to render there end to end whose DiT windows have its key
    (up to max_num_seqs). It leaves a chunk whose stream has an earlier one waiting (it would wait for that
    one, which nothing would render meanwhile), and keeps every other entry's place."""
    scheduler = code2wav_streams.ChunkScheduler.__new__(code2wav_streams.ChunkScheduler)
    scheduler._remote = SimpleNamespace(batch_frames=frozenset({64}))  # type: ignore[assignment]
    scheduler.max_batch = 3
    first, behind, other, third = _Stream(), _Stream(), _Stream(), _Stream()

    def entry(deadline: float, stream: _Stream, frames: int, turn: int, there: bool = False) -> tuple:
        work = SimpleNamespace(frames=frames, window=SimpleNamespace(key=(frames,)))
        return (deadline, int(deadline * 10), (stream, None, work, None if there else torch.zeros(1)), turn)

    def left() -> list[float]:
        queued = scheduler._vocoder_queue
        return [queued.get_nowait()[0] for _ in range(queued.qsize())]

    scheduler._vocoder_queue = queue.PriorityQueue()
    for item in [
        entry(1.0, behind, 128, 0),  # another length: stays
        entry(2.0, behind, 64, 1),  # its length, but behind its stream's chunk that stays: stays
        entry(2.5, first, 64, 1, there=True),  # to render there: another kind of call
        entry(3.0, other, 64, 0),  # taken
        entry(4.0, third, 64, 0),  # taken
        entry(5.0, other, 64, 1),  # taken: its stream's earlier chunk is taken before it
        entry(6.0, third, 64, 1),  # past a batch of four: stays
    ]:
        scheduler._vocoder_queue.put(item)
    taken = scheduler._companions(entry(0.5, first, 64, 0))
    assert [e[0] for e in taken] == [3.0, 4.0, 5.0]
    assert left() == [1.0, 2.0, 2.5, 6.0]

    for item in [
        entry(1.0, behind, 64, 0),  # a mel to vocode: another kind of call
        entry(2.0, behind, 64, 1, there=True),  # behind its stream's chunk that stays: stays
        entry(3.0, other, 128, 0, there=True),  # another window key: stays
        entry(4.0, third, 64, 0, there=True),  # taken
        entry(5.0, third, 64, 1, there=True),  # taken
        entry(6.0, other, 64, 1, there=True),  # past max_num_seqs: stays
    ]:
        scheduler._vocoder_queue.put(item)
    taken = scheduler._companions(entry(0.5, first, 64, 0, there=True))
    assert [e[0] for e in taken] == [4.0, 5.0]
    assert left() == [1.0, 2.0, 3.0, 6.0]
