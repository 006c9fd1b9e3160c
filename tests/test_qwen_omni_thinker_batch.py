"""The thinker decodes many replies together (issue 30): the lean loop's ids and latent are ``generate``'s.

tiny-qwen-omni's thinker (stage 0) joins the continuous-batching lean loop
(engine/pipelines/qwen_omni/thinker_decoder.py, docs/batching.md): each row's token ids, the RNG state it
hands to the talker and, when speaking, its ``latent`` (last hidden state + input embedding per position)
are what transformers' ``generate`` gives alone on the same inputs and seed; 8 concurrent speech requests
decode in shared thinker steps and each still gets its alone text, codes and samples, on this machine's
own kernels and on the guarded fallbacks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch

from engine import GenerationParams, GenerationRequest
from engine.engine import OmniEngine
from engine.modality import OutputModality
from engine.pipelines.qwen_omni.checkpoint import rng_state
from engine.pipelines.qwen_omni.thinker_decoder import ThinkerDecoder
from engine.stages.ar_sampling import sampling_kwargs
from engine.stages.ar_transformers import GLOBAL_RNG_LOCK
from engine.stages.row_plan import REFUSE_ENV
from tests.test_qwen_omni_talker_batch import PROMPTS, TALKER, build, crowd, run
from tests.test_qwen_omni_talker_batch import TalkerSpy as Spy

THINKER = 0


@pytest.fixture(scope="module")
def omni(session_data_dir) -> Iterator[OmniEngine]:
    engine = build(session_data_dir)
    yield engine
    engine.close()


def ask(seed: int, kind: str, prompt: str = PROMPTS[0]) -> GenerationRequest:
    """A chat request (text only), a speech request, or a speak_text one."""
    params = GenerationParams(seed=seed, voice="Ethan" if seed % 2 else "Chelsie")
    if kind == "chat":
        return GenerationRequest(prompt, params, modalities=(OutputModality.TEXT,))
    if kind == "speak_text":
        return GenerationRequest(prompt, params, speak_text=f"{prompt}, seed {seed}.")
    return GenerationRequest(prompt, params)


def generate_alone(runner: Any, job: Any, prepared: Any) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """transformers' ``generate`` on the thinker's own inputs from the request's seed, on the stage's one
    intra-op thread: the reply ids, generate's output and the global RNG state after it."""
    kwargs = {
        **prepared.model_inputs,
        **sampling_kwargs(job.params),
        **runner._generation_limits(job, prepared),
        **prepared.generate_kwargs,
    }
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with GLOBAL_RNG_LOCK, torch.inference_mode():
            torch.manual_seed(int(job.params["seed"]))
            result = runner.model.generate(**kwargs)
            after = rng_state(torch.device("cpu"))["cpu"]
    finally:
        torch.set_num_threads(before)
    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    return sequences[0, prepared.prompt_length :].cpu(), result, after


@pytest.mark.parametrize("kind", ["chat", "speech", "speak_text"])
@pytest.mark.parametrize("seed", [1, 2, 5, 9])
def test_lean_thinker_ids_latent_and_rng_state_are_generates(omni, seed, kind, monkeypatch):
    spy = Spy(omni, THINKER)
    steps: list[int] = []  # rows per lean decode step
    step = ThinkerDecoder.step

    def counted(self: ThinkerDecoder, states: Any, tokens: torch.Tensor, at: list[int]) -> torch.Tensor:
        steps.append(len(states))
        return step(self, states, tokens, at)

    monkeypatch.setattr(ThinkerDecoder, "step", counted)
    try:
        finished, step_rows = run(omni, ask(seed, kind, PROMPTS[seed % len(PROMPTS)]), THINKER)
    finally:
        spy.close()
    assert step_rows == 1  # in the lean loop (generate records no steps), alone
    # speak_text's reply is one forward over the prompt and the reply; the others decode token by token.
    assert steps == ([] if kind == "speak_text" else [1] * len(steps)) and (kind == "speak_text" or steps)
    assert "batched, tiles of" in omni.decode_paths()[THINKER]
    [(job, prepared, ids, outputs)] = spy.rows.values()
    expected, result, after = generate_alone(spy.runner, job, prepared)
    assert ids.numel() > 1 and ids.tolist() == expected.tolist()
    assert torch.equal(outputs["rng_state"]["cpu"], after)  # what the talker continues from
    if kind == "speak_text":
        said = spy.runner.reply_ids(f"{PROMPTS[seed % len(PROMPTS)]}, seed {seed}.")
        assert ids.tolist() == said.tolist()  # forced in the lean loop too
    if kind == "chat":
        assert "latent" not in outputs
        return
    latent, reference = outputs["latent"], spy.runner.latent(prepared, result).cpu()
    # The prompt and every reply token but the last (generate runs no forward for the last one).
    assert latent.shape == reference.shape == (prepared.prompt_length + ids.numel() - 1, latent.shape[1])
    assert float((latent - reference).abs().max()) < 1e-5
    assert finished.outputs[0].audio.size > 0


def check_alone_equals_crowded(engine: OmniEngine) -> None:
    requests = [
        ask(40 + i, "speak_text" if i % 4 == 3 else "speech", PROMPTS[i % len(PROMPTS)]) for i in range(8)
    ]
    thinker, talker = Spy(engine, THINKER), Spy(engine, TALKER)
    try:
        alone = [run(engine, request, THINKER)[0] for request in requests]
        alone_rows = [(thinker.rows[r.request_id], talker.rows[r.request_id]) for r in alone]
        crowded, step_rows = crowd(engine, requests, THINKER)
        crowded_rows = [(thinker.rows[r.request_id], talker.rows[r.request_id]) for r in crowded]
    finally:
        thinker.close()
        talker.close()
    # The six sampled replies share thinker decode steps; the two speak_text ones are made in one
    # forward each at admission (docs/batching.md, "Teacher-forced replies").
    decoding = [rows for request, rows in zip(requests, step_rows, strict=True) if request.speak_text is None]
    assert len(decoding) == 6 and max(decoding) == 6 and min(decoding) >= 2, step_rows
    assert len({tuple(t[2].tolist()) for t, _ in alone_rows}) == 8  # eight different replies
    for (a_thinker, a_talker), (c_thinker, c_talker) in zip(alone_rows, crowded_rows, strict=True):
        assert a_thinker[2].tolist() == c_thinker[2].tolist()
        assert torch.equal(a_thinker[3]["latent"], c_thinker[3]["latent"])  # bit for bit
        assert torch.equal(a_thinker[3]["rng_state"]["cpu"], c_thinker[3]["rng_state"]["cpu"])
        assert a_talker[2].tolist() == c_talker[2].tolist()  # the codes
    for a, b in zip(alone, crowded, strict=True):
        assert a.outputs[0].text and a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].audio.size > 0
        assert np.array_equal(a.outputs[0].audio, b.outputs[0].audio)


def test_eight_concurrent_speech_requests_get_their_alone_text_codes_and_samples(omni):
    check_alone_equals_crowded(omni)
    assert omni.decode_paths()[THINKER].startswith("batched, tiles of")


def test_guarded_fallbacks_still_share_steps_and_keep_the_alone_bytes(session_data_dir, monkeypatch):
    monkeypatch.setenv(REFUSE_ENV, "tiled,live-rows,single-row-batch")
    engine = build(session_data_dir)
    try:
        check_alone_equals_crowded(engine)
        described = engine.decode_paths()[THINKER]
        assert "guarded fallback" in described and "one row per call" in described, described
    finally:
        engine.close()


def test_audio_in_and_other_dtypes_stay_on_generate(omni):
    """A prompt with audio in keeps ``generate`` (no lean steps) and still speaks; another dtype's model
    gets no lean decoder (and no weight copies)."""
    t = np.arange(16_000) / 16_000
    heard = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    request = GenerationRequest("", GenerationParams(seed=3), input_audio=(heard,))
    finished, step_rows = run(omni, request, THINKER)
    assert step_rows == 0 and finished.outputs[0].audio.size > 0
    runner = cast(Any, omni.runners[THINKER])
    assert runner.concurrent and runner.fast_decoder() is not None
    half = ThinkerDecoder(copy.deepcopy(runner.model).to(torch.bfloat16))
    assert not half.usable and half.layers == []


def test_a_forced_reply_that_meets_a_stop_id_stops_there_as_generate_does(omni, monkeypatch):
    """A stop id inside the text to speak ends the reply there, as a decode of it would: the forced
    reply's one forward computes positions past the stop, and the latent leaves them out."""
    runner = cast(Any, omni.runners[THINKER])
    [stop] = runner.tokenizer(".", add_special_tokens=False)["input_ids"]
    prepare_job = runner.prepare_job

    def with_a_stop_id(job: Any) -> Any:
        job.params["stop_token_ids"] = [stop]
        return prepare_job(job)

    monkeypatch.setattr(runner, "prepare_job", with_a_stop_id)
    spy = Spy(omni, THINKER)
    try:
        request = GenerationRequest("", GenerationParams(seed=3), speak_text="stop. not this")
        finished, _ = run(omni, request, THINKER)
    finally:
        spy.close()
    [(job, prepared, ids, outputs)] = spy.rows.values()
    expected, result, after = generate_alone(runner, job, prepared)
    assert (
        ids.tolist() == expected.tolist() == runner.tokenizer("stop.", add_special_tokens=False)["input_ids"]
    )
    assert torch.equal(outputs["rng_state"]["cpu"], after)
    latent, reference = outputs["latent"], runner.latent(prepared, result).cpu()
    assert latent.shape == reference.shape == (prepared.prompt_length + ids.numel() - 1, latent.shape[1])
    assert float((latent - reference).abs().max()) < 1e-5
    assert finished.outputs[0].text == "stop."
