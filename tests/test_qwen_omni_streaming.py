"""Streaming speech on tiny-qwen-omni: code2wav renders the talker's codes in chunks while it speaks.

The deploy config's ``chunk_size`` on code2wav (docs/speech.md, "Streaming"): one AudioDelta per chunk, in
order, joined into the run's audio; the first chunk reaches the client while the talker is still
generating; the chunks depend on the codes and the seed only; cancel stops all three stages.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import GenerationParams, GenerationRequest, RunFailed, RunFinished, StageStarted
from engine.building import build_pipeline_config
from engine.config import DeployConfigError
from engine.engine import OmniEngine, build_engine
from engine.events import AudioDelta, DiffusionStep, StageFinished, StageStatus
from engine.modality import OutputAccumulator, OutputModality
from engine.models import describe_model
from engine.pipelines.qwen_omni.code2wav_streams import LATER_CHUNKS, ChunkPlan, ChunkScheduler
from engine.stages.base import StageJob
from engine.streaming import CHUNK_FEED_KEY, ChunkFeed, chunking_problems
from engine.tempo import stretch
from tests.conftest import tiny_deploy

CHUNK = 12  # codes in the first chunk: one DiT attention block of the tiny model
LATER = CHUNK * LATER_CHUNKS  # codes in every later chunk (docs/speech.md, "Chunk sizes")
BLOCK = AHEAD = 12  # the tiny DiT's attention block, and the codes a chunk's window reaches past it
SAMPLES_PER_CODE = 480  # 2 mel frames of 240 samples
DEADLINE_S = 300  # bounds a hang only


@pytest.fixture(scope="module")
def streaming(session_data_dir) -> Iterator[OmniEngine]:
    engine = build_engine(
        "tiny-qwen-omni",
        tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": CHUNK}),
        data_dir=session_data_dir,
    )
    yield engine
    engine.close()


def speak(seed: int = 2, **params) -> GenerationRequest:
    return GenerationRequest("say hello", GenerationParams(seed=seed, **params))


def events_of(engine: OmniEngine, request: GenerationRequest) -> list:
    return list(engine.stream(engine.resolve(request)))


def chunks_of(events: list) -> list[np.ndarray]:
    return [e.samples for e in events if isinstance(e, AudioDelta)]


class TalkerGate:
    """Holds the talker on its own thread once it has generated ``at`` codes, until released: the test
    then sees what the other stages do while the talker is still speaking (no sleeps, only events)."""

    def __init__(self, engine: OmniEngine, at: int) -> None:
        self.runner = engine.runners[1]
        self.at = at
        self.held = threading.Event()
        self.released = threading.Event()
        original = self.runner.emit_delta

        def gated(job: StageJob, new_ids: torch.Tensor, generated: torch.Tensor) -> None:
            original(job, new_ids, generated)
            if generated.numel() >= self.at and not self.released.is_set():
                self.held.set()
                self.released.wait(DEADLINE_S)

        self.runner.emit_delta = gated  # type: ignore[method-assign]

    def close(self) -> None:
        self.released.set()
        del self.runner.emit_delta  # back to the class's method


def chunk_count(codes: int) -> int:
    """The chunks a stream of ``codes`` codes is rendered in (docs/speech.md, "Chunk sizes"): CHUNK
    codes, then LATER each, except that an utterance ending inside a chunk's window (the chunk, AHEAD
    codes and the rest of that block) ends with that chunk."""
    start, count = 0, 0
    while start < codes:
        size = CHUNK if start == 0 else LATER
        reach = -(-(start + size + AHEAD) // BLOCK) * BLOCK
        start = codes if codes <= reach else start + size
        count += 1
    return count


def test_an_utterance_ending_inside_a_chunks_window_ends_with_that_chunk(streaming):
    """A remainder the window already holds is no chunk of its own: codes 13 to 24 come with the first
    chunk (its window reaches 24), 25 make two chunks; from the engine's plan and from a real stream."""
    plan = ChunkPlan.of(streaming.runners[2].model, CHUNK)
    assert (plan.reach(0), plan.ready_at(0)) == (24, 25)  # the window, and one code more to know
    assert [plan.end(0, total) for total in (5, 13, 24, 25, 200)] == [5, 13, 24, 12, 12]
    assert plan.end(0, None) == 12 and plan.window(0, 24) == (0, 24)
    assert (plan.reach(12), plan.end(12, 48), plan.end(12, 49)) == (48, 48, 36)
    assert [chunk_count(n) for n in (5, 12, 13, 24, 25, 48, 49)] == [1, 1, 1, 1, 2, 2, 3]
    runner = streaming.runners[2]
    generator = torch.Generator().manual_seed(7)
    for total in (24, 25):
        codes = torch.randint(0, 100, (1, total), generator=generator)
        feed = ChunkFeed()
        feed.publish({"codes": codes}, final=True)
        job = _code2wav_job(streaming, codes, 3, feed)
        chunks: list[np.ndarray] = []
        job.emit = lambda event, chunks=chunks: (
            chunks.append(event.samples) if isinstance(event, AudioDelta) else None
        )
        with torch.inference_mode():
            runner.stream(job, feed)
        assert [c.size // SAMPLES_PER_CODE for c in chunks] == ([24] if total == 24 else [12, 13])


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_an_empty_utterance_ends_with_one_empty_delta_alone_and_among_others(streaming, speed):
    """No codes (the talker's first code was its end): nothing to speak, one empty AudioDelta and a
    finished stream, rendered alone or by the scheduler beside a stream that speaks."""
    runner = streaming.runners[2]
    events: dict[str, list] = {"alone": [], "scheduled": [], "other": []}
    finished = {name: threading.Event() for name in ("scheduled", "other")}
    jobs = {}
    for name, count in (("alone", 0), ("scheduled", 0), ("other", 30)):
        codes = torch.randint(0, 100, (1, count), generator=torch.Generator().manual_seed(1))
        feed = ChunkFeed()
        feed.publish({"codes": codes}, final=True)
        job = _code2wav_job(streaming, codes, 4, feed)
        job.params["speed"] = speed
        job.emit = events[name].append
        jobs[name] = (job, feed)
    with torch.inference_mode():
        runner.stream(*jobs["alone"])
    statuses = {}
    for name in ("other", "scheduled"):

        def done(status, error, name: str = name) -> None:
            statuses[name] = (status, error)
            finished[name].set()

        runner.submit(jobs[name][0], done)
    assert all(event.wait(DEADLINE_S) for event in finished.values())
    assert statuses["scheduled"] == (StageStatus.SUCCEEDED, None) == statuses["other"]
    for name in ("alone", "scheduled"):
        deltas = [e for e in events[name] if isinstance(e, AudioDelta)]
        assert [d.samples.size for d in deltas] == [0]
    assert sum(e.samples.size for e in events["other"] if isinstance(e, AudioDelta)) > 0


def test_chunks_arrive_in_order_and_join_into_the_runs_audio(streaming):
    events = events_of(streaming, speak())
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    audio = finished.outputs[0].audio
    chunks = chunks_of(events)
    assert len(chunks) >= 2  # seed 2 speaks more than one chunk
    sizes = [CHUNK] + [LATER] * (len(chunks) - 2)  # codes of every chunk but the last
    assert [c.size for c in chunks[:-1]] == [n * SAMPLES_PER_CODE for n in sizes]
    # The last one takes what is left, up to its window's reach (an utterance ending inside it).
    assert 0 < chunks[-1].size <= (LATER + AHEAD) * SAMPLES_PER_CODE
    assert len(chunks) == chunk_count(audio.size // SAMPLES_PER_CODE)
    assert np.array_equal(np.concatenate(chunks), audio)
    assert 0.01 < float(np.sqrt(np.mean(audio**2))) < 0.9  # audible
    started = [e for e in events if isinstance(e, StageStarted) and e.stage_id == 2]
    assert started[0].total == 0  # chunks are counted as the talker speaks
    steps = [e for e in events if isinstance(e, DiffusionStep) and e.stage_id == 2]
    assert [s.step for s in steps] == list(range(1, len(chunks) + 1))
    assert steps[-1].total == len(chunks) and all(s.total == 0 for s in steps[:-1])


def test_a_stretched_stream_is_the_whole_utterance_stretched(streaming):
    """``speed`` while streaming: each chunk goes through the stretcher as it comes (engine/tempo.py);
    joined, the deltas are the run's audio, and that is the unstretched utterance stretched at once."""
    spoken = events_of(streaming, speak())[-1].outputs[0].audio
    events = events_of(streaming, speak(speed=0.5))
    slow = events[-1].outputs[0].audio
    assert np.array_equal(slow, stretch(spoken, 0.5))
    chunks = chunks_of(events)
    assert len(chunks) >= 3 and np.array_equal(np.concatenate(chunks), slow)
    assert chunks[0].size > 0  # the first chunk is heard at once, stretched


def test_the_first_chunk_is_heard_while_the_talker_is_still_speaking(streaming):
    """The talker is held after two chunks' worth of codes: the first chunk still arrives, so code2wav
    started on the talker's partial output, not on its end."""
    gate = TalkerGate(streaming, at=2 * CHUNK + 1)  # the first window's codes and one more
    first = threading.Event()
    events: list = []
    done = threading.Event()

    def sink(event) -> None:
        events.append(event)
        if isinstance(event, AudioDelta):
            first.set()
        if isinstance(event, RunFinished | RunFailed):
            done.set()

    try:
        streaming.submit(streaming.resolve(speak()), sink)
        assert first.wait(DEADLINE_S)
        assert gate.held.is_set() and not gate.released.is_set()
        assert not [e for e in events if isinstance(e, StageFinished) and e.stage_id == 1]
    finally:
        gate.close()
    assert done.wait(DEADLINE_S)
    assert isinstance(events[-1], RunFinished)
    # Held or not, the same chunks (they depend on the codes and the seed only).
    assert [c.tobytes() for c in chunks_of(events)] == [
        c.tobytes() for c in chunks_of(events_of(streaming, speak()))
    ]


def test_cancel_after_the_first_chunk_stops_the_talker_and_code2wav(streaming):
    gate = TalkerGate(streaming, at=2 * CHUNK + 1)
    events: list = []
    done = threading.Event()
    stopped = threading.Event()

    def sink(event) -> None:
        events.append(event)
        if isinstance(event, AudioDelta) and len(chunks_of(events)) == 1:
            streaming.cancel(event.request_id)
            gate.released.set()  # the talker goes on, sees the cancel at its next token
        if isinstance(event, RunFinished | RunFailed):
            done.set()
        if {e.stage_id for e in events if isinstance(e, StageFinished)} >= {1, 2}:
            stopped.set()

    try:
        streaming.submit(streaming.resolve(speak()), sink)
        assert done.wait(DEADLINE_S) and stopped.wait(DEADLINE_S)
    finally:
        gate.close()
    terminal = [e for e in events if isinstance(e, RunFinished | RunFailed)]
    assert len(terminal) == 1 and isinstance(terminal[0], RunFailed) and terminal[0].cancelled
    status = {e.stage_id: e.status for e in events if isinstance(e, StageFinished)}
    assert status == {0: StageStatus.SUCCEEDED, 1: StageStatus.CANCELLED, 2: StageStatus.CANCELLED}
    talker = next(e for e in events if isinstance(e, StageFinished) and e.stage_id == 1)
    assert talker.output_tokens < 60  # stopped before its budget
    assert len(chunks_of(events)) == 1
    assert streaming.in_flight == 0
    assert isinstance(events_of(streaming, speak())[-1], RunFinished)  # the stages serve on


def test_same_request_and_seed_give_the_same_chunks_alone_and_among_eight(streaming):
    alone = chunks_of(events_of(streaming, speak(seed=11)))
    requests = [
        speak(seed=11) if i == 3 else speak(seed=20 + i, voice="Ethan" if i % 2 else None) for i in range(8)
    ]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = events_of(streaming, requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert len(results) == 8 and all(isinstance(r[-1], RunFinished) for r in results.values())
    assert [c.tobytes() for c in chunks_of(results[3])] == [c.tobytes() for c in alone]
    assert len({results[i][-1].outputs[0].audio.tobytes() for i in range(8)}) > 1


def talker_codes(streaming: OmniEngine, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """The streamed run of ``speak(seed=seed)``: its audio, and the codes the talker made (as code2wav's
    feed last held them)."""
    runner, feeds = streaming.runners[2], []
    original = runner.submit

    def spy(job: StageJob, done) -> None:
        feeds.append(job.inputs[CHUNK_FEED_KEY])
        original(job, done)

    runner.submit = spy  # type: ignore[method-assign]
    try:
        audio = events_of(streaming, speak(seed=seed))[-1].outputs[0].audio
    finally:
        del runner.submit
    return audio, torch.as_tensor(feeds[-1].snapshot()[0]["codes"]).reshape(1, -1)


def _code2wav_job(
    streaming: OmniEngine, codes: torch.Tensor, seed: int, feed: ChunkFeed | None = None
) -> StageJob:
    resolved = streaming.resolve(speak(seed=seed))
    params = {**resolved.stage_params[2], "seed": seed}
    inputs = {CHUNK_FEED_KEY: feed} if feed is not None else {"codes": codes}
    return StageJob(
        "measure", 0, inputs, params, lambda event: None, OutputAccumulator((OutputModality.AUDIO,))
    )


@pytest.mark.parametrize("seed", [2, 5])
def test_streamed_chunks_match_the_whole_utterance_render_within_the_documented_bound(streaming, seed):
    """The streamed samples against one render of the whole utterance from the same codes and noise:
    what the chunk windows' limited context costs (docs/speech.md, "Streaming, measured")."""
    runner = streaming.runners[2]
    streamed, codes = talker_codes(streaming, seed)
    assert codes.shape[1] > 2 * CHUNK  # more than one chunk (chunk_count)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the stage's intra-op threads: the same kernels
    try:
        with torch.inference_mode():
            whole = runner.render(_code2wav_job(streaming, codes, seed)).numpy()
            # The chunks depend on the codes only: a feed that is final at once gives the same samples.
            feed = ChunkFeed()
            feed.publish({"codes": codes}, final=True)
            job = _code2wav_job(streaming, codes, seed, feed)
            runner.stream(job, feed)
            replayed = job.deliver_outputs()["audio"].numpy()
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(replayed, streamed)
    assert whole.shape == streamed.shape
    difference = np.abs(streamed - whole)
    snr = 10 * math.log10(
        float(np.sum(whole.astype(np.float64) ** 2)) / max(float(np.sum(difference**2.0)), 1e-30)
    )
    assert float(difference.max()) < 1e-3 and snr > 80.0, (float(difference.max()), snr)


def test_chunk_size_is_validated_naming_the_field():
    source = describe_model("tiny-qwen-omni")
    for stage, value, says in (
        (2, 0, "greater than or equal to 1"),
        (2, 5000, "4096"),
        (0, 12, "one AR stage"),  # the thinker reads the request, not an AR stage
    ):
        with pytest.raises(DeployConfigError) as info:
            build_pipeline_config(
                source, tiny_deploy("tiny-qwen-omni", **{f"stage{stage}": {"chunk_size": value}})
            )
        problems = [p for p in info.value.problems if p.key == "chunk_size"]
        assert problems and problems[0].stage == stage and says in problems[0].message, info.value.render()
    config = build_pipeline_config(source, tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": 24}))
    assert config.stage(2).engine_args.chunk_size == 24
    plain = build_pipeline_config(source, tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": None}))
    assert "chunk_size" not in plain.stage(2).engine_args.to_dict()  # unset: the hash stays what it was
    assert config.config_hash() != plain.config_hash()


def test_a_stage_that_cannot_render_chunks_is_refused_at_start(glm_engine):
    """GLM-Image's diffusion stage is fed by an AR stage, so the config allows the key; its runner
    takes its input whole, so the engine refuses it, naming the field."""
    stage = glm_engine.config.stage(1)
    chunked = replace(stage, engine_args=replace(stage.engine_args, chunk_size=8))
    config = replace(glm_engine.config, stages=(glm_engine.config.stage(0), chunked))
    problems = chunking_problems(config, glm_engine.runners)
    assert [(p.stage, p.key) for p in problems] == [(1, "chunk_size")]
    assert "cannot consume its input in chunks" in problems[0].message
    assert chunking_problems(glm_engine.config, glm_engine.runners) == []


# -- many listeners: the chunk scheduler (docs/speech.md, "Many listeners") ----------------------------


def test_a_new_stream_is_heard_before_the_playing_one_goes_on(streaming, monkeypatch):
    """Two streams handed to code2wav one right after the other, every code known: the first one's first
    chunk, then the newcomer's first chunk (its listener has nothing yet; the first one's has a chunk to
    play), then turns by whose listener runs out first; each stream's samples are its alone render's. Both
    are rendered in this process: a stream the second process renders end to end (where an earlier test
    started it) comes in parallel, in the order its chunks finish (tests/test_dit_batch.py)."""
    monkeypatch.setattr(ChunkScheduler, "_renders_there", lambda self: False)
    runner = streaming.runners[2]
    codes = {seed: talker_codes(streaming, seed)[1] for seed in (2, 5)}
    assert all(c.shape[1] > 2 * CHUNK for c in codes.values())  # two chunks or more each
    order: list[str] = []
    lock = threading.Lock()
    finished = {seed: threading.Event() for seed in codes}
    jobs = {}
    for seed, stream_codes in codes.items():
        feed = ChunkFeed()
        feed.publish({"codes": stream_codes}, final=True)
        job = _code2wav_job(streaming, stream_codes, seed, feed)
        job.params["num_inference_steps"] = 40  # each chunk takes long enough for the hand-over below

        def emit(event, name: str = f"s{seed}") -> None:
            if isinstance(event, AudioDelta):
                with lock:
                    order.append(name)

        job.emit = emit
        jobs[seed] = job
    for seed, job in jobs.items():
        runner.submit(job, lambda status, error, seed=seed: finished[seed].set())
    assert all(event.wait(DEADLINE_S) for event in finished.values())
    assert order[:3] == ["s2", "s5", "s2"]
    assert [order.count(f"s{seed}") for seed in codes] == [chunk_count(c.shape[1]) for c in codes.values()]
    for seed, job in jobs.items():
        alone_feed = ChunkFeed()
        alone_feed.publish({"codes": codes[seed]}, final=True)
        alone = _code2wav_job(streaming, codes[seed], seed, alone_feed)
        alone.params["num_inference_steps"] = 40
        before = torch.get_num_threads()
        torch.set_num_threads(runner.intra_op_threads or before)  # the stage's: the same kernels
        try:
            with torch.inference_mode():
                runner.stream(alone, alone_feed)
        finally:
            torch.set_num_threads(before)
        assert np.array_equal(
            job.deliver_outputs()["audio"].numpy(), alone.deliver_outputs()["audio"].numpy()
        )


def test_cancelling_one_of_eight_streams_leaves_the_others_whole(streaming):
    requests = [speak(seed=30 + i) for i in range(8)]
    alone = [chunks_of(events_of(streaming, r)) for r in requests]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        events: list = []
        over = threading.Event()

        def sink(event) -> None:
            events.append(event)
            if i == 2 and isinstance(event, AudioDelta):
                streaming.cancel(event.request_id)  # after its first chunk
            if isinstance(event, RunFinished | RunFailed):
                over.set()

        streaming.submit(streaming.resolve(requests[i]), sink)
        assert over.wait(DEADLINE_S)
        results[i] = events

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert isinstance(results[2][-1], RunFailed) and results[2][-1].cancelled
    for i in (0, 1, 3, 4, 5, 6, 7):
        assert isinstance(results[i][-1], RunFinished), i
        chunks = chunks_of(results[i])
        # In order, back to back: the joined chunks are the run's audio and the alone run's chunks.
        assert [c.tobytes() for c in chunks] == [c.tobytes() for c in alone[i]], i
        assert np.array_equal(np.concatenate(chunks), results[i][-1].outputs[0].audio)
    assert streaming.in_flight == 0
