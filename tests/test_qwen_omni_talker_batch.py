"""The talker decodes many speech streams together (issue 30): the lean loop's codes are ``generate``'s.

tiny-qwen-omni's talker (stage 1) joins the continuous-batching lean loop
(engine/pipelines/qwen_omni/talker_decoder.py, docs/batching.md): each row's codec ids and the RNG state it
hands to code2wav are exactly what transformers' ``generate`` gives alone on the same inputs and stream;
8 concurrent speech requests decode in shared steps and each still gets its alone codes and samples, on
this machine's own kernels and on the guarded fallbacks.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch

from engine import GenerationParams, GenerationRequest, RunFinished
from engine.engine import OmniEngine, build_engine
from engine.events import StageFinished
from engine.pipelines.qwen_omni.checkpoint import rng_state, set_rng_state
from engine.pipelines.qwen_omni.talker_decoder import TalkerDecoder
from engine.stages.ar_sampling import sampling_kwargs
from engine.stages.ar_transformers import GLOBAL_RNG_LOCK
from engine.stages.row_plan import REFUSE_ENV
from tests.conftest import tiny_deploy

TALKER = 1
DEADLINE_S = 300  # bounds a hang only
PROMPTS = ["say hello", "count to three", "name a colour", "good morning"]


class TalkerSpy:
    """Records, per request, the talker's (or ``stage``'s) job, its prepared inputs, the ids it made and
    its outputs (the stage's ``finish``, called when a lean-loop row ends)."""

    def __init__(self, engine: OmniEngine, stage: int = TALKER) -> None:
        self.runner = cast(Any, engine.runners[stage])
        self.rows: dict[str, tuple[Any, Any, torch.Tensor, dict[str, Any]]] = {}
        self.lock = threading.Lock()
        original = self.runner.finish

        def finish(job: Any, generated: torch.Tensor, prepared: Any) -> dict[str, Any]:
            outputs = original(job, generated, prepared)
            with self.lock:
                self.rows[job.request_id] = (job, prepared, generated.clone(), outputs)
            return outputs

        self.runner.finish = finish

    def close(self) -> None:
        del self.runner.finish


def build(data_dir: Any) -> OmniEngine:
    return build_engine("tiny-qwen-omni", tiny_deploy("tiny-qwen-omni"), data_dir=data_dir)


@pytest.fixture(scope="module")
def omni(session_data_dir) -> Iterator[OmniEngine]:
    engine = build(session_data_dir)
    yield engine
    engine.close()


def speak(seed: int, voice: str | None = None, prompt: str = PROMPTS[0]) -> GenerationRequest:
    return GenerationRequest(prompt, GenerationParams(seed=seed, voice=voice))


def run(engine: OmniEngine, request: GenerationRequest, stage: int = TALKER) -> tuple[RunFinished, int]:
    """The request's finished run and the most rows one of its talker (``stage``) decode steps held."""
    step_rows, finished = 0, None
    for event in engine.stream(engine.resolve(request)):
        if isinstance(event, StageFinished) and event.stage_id == stage:
            step_rows = event.step_rows
        if isinstance(event, RunFinished):
            finished = event
    assert finished is not None
    return finished, step_rows


def generate_alone(runner: Any, job: Any, prepared: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``generate`` on the talker's own inputs, from the RNG state the thinker handed on,
    on the stage's one intra-op thread: the codes and the global RNG state after it."""
    kwargs = {
        **prepared.model_inputs,
        **sampling_kwargs(job.params),
        **runner._generation_limits(job, prepared),
        **prepared.generate_kwargs,
    }
    kwargs["inputs_embeds"] = kwargs["inputs_embeds"].clone()  # the forward adds into it in place
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with GLOBAL_RNG_LOCK, torch.inference_mode():
            set_rng_state(job.inputs["rng_state"], torch.device("cpu"))
            sequences = runner.model.generate(**kwargs)
            after = rng_state(torch.device("cpu"))["cpu"]
    finally:
        torch.set_num_threads(before)
    return sequences[0, prepared.prompt_length :].cpu(), after


@pytest.mark.parametrize(("seed", "voice"), [(1, "Chelsie"), (2, "Ethan"), (5, "Chelsie"), (9, "Ethan")])
def test_lean_loop_codes_and_rng_state_are_generates(omni, seed, voice):
    spy = TalkerSpy(omni)
    try:
        _, step_rows = run(omni, speak(seed, voice))
    finally:
        spy.close()
    assert step_rows == 1  # decoded in the lean loop (generate records no steps), alone
    assert "batched, tiles of" in omni.decode_paths()[TALKER]
    [(job, prepared, codes, outputs)] = spy.rows.values()
    expected, after = generate_alone(spy.runner, job, prepared)
    assert codes.numel() > 0 and codes.tolist() == expected.tolist()
    assert torch.equal(outputs["rng_state"]["cpu"], after)  # what code2wav continues from
    assert not torch.equal(after, job.inputs["rng_state"]["cpu"])  # the talker did draw


def crowd(
    engine: OmniEngine, requests: list[GenerationRequest], stage: int = TALKER
) -> tuple[list[RunFinished], list[int]]:
    """The requests from 8 threads at once. The talker's (``stage``'s) decode thread is held at its first
    report until all of them have reached it, so they decode in shared steps (no sleeps: events only)."""
    runner = cast(Any, engine.runners[stage])
    arrived = threading.Semaphore(0)
    all_in = threading.Event()
    original_submit, original_emit = runner.submit, runner.emit_delta

    def submit(job: Any, done: Any) -> None:
        original_submit(job, done)
        arrived.release()

    def emit_delta(job: Any, new_ids: torch.Tensor, generated: torch.Tensor) -> None:
        original_emit(job, new_ids, generated)
        all_in.wait(DEADLINE_S)

    runner.submit, runner.emit_delta = submit, emit_delta
    results: list[Any] = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = run(engine, requests[i], stage)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    try:
        for thread in threads:
            thread.start()
        for _ in requests:
            assert arrived.acquire(timeout=DEADLINE_S)
        all_in.set()
        for thread in threads:
            thread.join(DEADLINE_S)
    finally:
        all_in.set()
        del runner.submit, runner.emit_delta
    assert all(r is not None for r in results)
    return [r[0] for r in results], [r[1] for r in results]


def check_alone_equals_crowded(engine: OmniEngine) -> None:
    requests = [speak(30 + i, "Ethan" if i % 2 else "Chelsie", PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    spy = TalkerSpy(engine)
    try:
        alone = []
        for request in requests:
            alone.append(run(engine, request)[0])
        alone_codes = [spy.rows[r.request_id][2].tolist() for r in alone]
        crowded, step_rows = crowd(engine, requests)
        crowded_codes = [spy.rows[r.request_id][2].tolist() for r in crowded]
        crowded_states = [spy.rows[r.request_id][3]["rng_state"]["cpu"] for r in crowded]
        alone_states = [spy.rows[r.request_id][3]["rng_state"]["cpu"] for r in alone]
    finally:
        spy.close()
    assert max(step_rows) == 8 and min(step_rows) >= 2, step_rows  # shared decode steps
    assert len({tuple(c) for c in alone_codes}) == 8  # eight different utterances
    assert crowded_codes == alone_codes
    assert all(torch.equal(a, b) for a, b in zip(alone_states, crowded_states, strict=True))
    for a, b in zip(alone, crowded, strict=True):
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].audio.size > 0
        assert np.array_equal(a.outputs[0].audio, b.outputs[0].audio)


def test_eight_concurrent_speech_requests_get_their_alone_codes_and_samples(omni):
    check_alone_equals_crowded(omni)
    assert omni.decode_paths()[TALKER].startswith("batched, tiles of")


@pytest.mark.parametrize(
    ("refuse", "words"),
    [
        ("tiled", ("in one call on the live rows", "as single-row products in one call", "one row per call")),
        ("tiled,live-rows,single-row-batch", ("one row per call",)),  # the last resort
    ],
)
def test_guarded_fallbacks_still_share_steps_and_keep_the_alone_bytes(
    session_data_dir, monkeypatch, refuse, words
):
    monkeypatch.setenv(REFUSE_ENV, refuse)
    engine = build(session_data_dir)
    try:
        check_alone_equals_crowded(engine)
        described = engine.decode_paths()[TALKER]
        assert "guarded fallback" in described and any(w in described for w in words), described
    finally:
        engine.close()


def test_a_greedy_talker_hands_on_the_stream_it_was_given(session_data_dir):
    """A talker without sampling draws nothing: its codes are generate's and the RNG state it hands on is
    the one it received, as the global RNG would hold it after a greedy generate."""
    engine = build_engine(
        "tiny-qwen-omni",
        tiny_deploy(
            "tiny-qwen-omni", stage1={"default_sampling_params": {"temperature": 0, "max_tokens": 40}}
        ),
        data_dir=session_data_dir,
    )
    spy = TalkerSpy(engine)
    try:
        _, step_rows = run(engine, speak(3))
        [(job, prepared, codes, outputs)] = spy.rows.values()
        expected, after = generate_alone(spy.runner, job, prepared)
    finally:
        spy.close()
        engine.close()
    assert step_rows == 1
    assert codes.numel() > 0 and codes.tolist() == expected.tolist()
    assert torch.equal(outputs["rng_state"]["cpu"], after)
    assert torch.equal(after, job.inputs["rng_state"]["cpu"])


def test_the_lean_decoder_is_offered_only_where_it_was_checked(omni):
    """float32 on a CPU: the talker is a concurrent (continuous-batching) runner; another dtype keeps
    ``generate`` (the decoder declines it, and copies no weights for it)."""
    runner = omni.runners[TALKER]
    assert runner.concurrent and runner.fast_decoder() is not None
    half = TalkerDecoder(copy.deepcopy(runner.model).to(torch.bfloat16))
    assert not half.usable and half.layers == []
