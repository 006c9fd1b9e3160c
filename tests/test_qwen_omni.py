"""The qwen-omni family on tiny-qwen-omni: split == transformers' one-shot, modalities, voices, invariance."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

from engine import (
    ChatTurn,
    GenerationParams,
    GenerationRequest,
    RequestError,
    RunFailed,
    RunFinished,
    StageStarted,
    TokenProgress,
)
from engine.engine import OmniEngine, build_engine
from engine.events import AudioDelta, TextDelta
from engine.modality import OutputModality
from engine.pipelines.qwen_omni import chat_messages
from engine.tempo import SLACK, stretch
from tests.conftest import tiny_deploy
from tests.qwen_omni_reference import TALKER_MAX, generate_one_shot

PROMPT = "say hello"


# The whole-utterance render (no chunk_size): its waveform equals the one-shot generate's sample for sample;
# the preset's streamed render is checked against it in tests/test_qwen_omni_streaming.py.
WHOLE_RENDER = tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": None})


@pytest.fixture(scope="module")
def omni(session_data_dir) -> Iterator[OmniEngine]:
    engine = build_engine("tiny-qwen-omni", WHOLE_RENDER, data_dir=session_data_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def one_shot(omni):
    """transformers' own model on the engine's folder, and its tokenizer."""
    path = omni.model.path
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(
        path
    )


def speak(prompt: str = PROMPT, modalities=None, **params) -> GenerationRequest:
    params.setdefault("seed", 7)
    return GenerationRequest(prompt, GenerationParams(**params), modalities=modalities)


def events_of(engine: OmniEngine, request: GenerationRequest) -> list:
    return list(engine.stream(engine.resolve(request)))


def one_shot_generate(one_shot, seed: int, voice: str, temperature: float) -> tuple[str, torch.Tensor]:
    """The one-shot call on the prompt the thinker stage builds, with the preset's sampling."""
    model, tokenizer = one_shot
    inputs = tokenizer.apply_chat_template(
        chat_messages([ChatTurn("user", PROMPT)], speak=True),
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    sequences, wave = generate_one_shot(model, inputs, seed=seed, voice=voice, temperature=temperature)
    text = tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return text, wave


@pytest.mark.parametrize(
    ("seed", "voice", "temperature"), [(1, "Chelsie", 0.8), (2, "Ethan", 0.8), (3, "Ethan", 0)]
)
def test_split_stages_make_the_one_shot_generate_samples_exactly(omni, one_shot, seed, voice, temperature):
    """Thinker, talker and code2wav as three stages, handing the RNG stream on, give transformers'
    one-shot ``generate(..., speaker=...)`` waveform sample for sample (and its text)."""
    assert {runner.intra_op_threads for runner in omni.runners.values()} == {1}
    output = omni.run(speak(seed=seed, voice=voice, temperature=temperature)).outputs[0]
    text, wave = one_shot_generate(one_shot, seed, voice, temperature)
    assert output.text == text and text
    assert output.sample_rate == 24_000
    assert output.audio is not None and output.audio.dtype == np.float32 and output.audio.ndim == 1
    assert output.audio.size > 0
    assert np.array_equal(output.audio, wave.numpy())


def test_text_and_audio_stream_as_events_and_add_up_to_the_outputs(omni):
    events = events_of(omni, speak())
    started = [e.stage_id for e in events if isinstance(e, StageStarted)]
    assert started == [0, 1, 2]
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    output = finished.outputs[0]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == output.text
    chunks = [e for e in events if isinstance(e, AudioDelta)]
    assert chunks and all(e.stage_id == 2 and e.sample_rate == 24_000 for e in chunks)
    assert np.array_equal(np.concatenate([e.samples for e in chunks]), output.audio)
    assert 0.01 < float(np.sqrt(np.mean(output.audio**2))) < 0.9  # audible, not clipped throughout
    assert output.audio.size <= TALKER_MAX * 480  # the talker's budget bounds the utterance


def test_text_modality_runs_the_thinker_alone(omni):
    events = events_of(omni, speak(modalities=(OutputModality.TEXT,)))
    assert [e.stage_id for e in events if isinstance(e, StageStarted)] == [0]
    assert not [e for e in events if isinstance(e, AudioDelta)]
    output = events[-1].outputs[0]
    assert output.text and output.audio is None and output.sample_rate == 0


def test_audio_modality_gives_audio_without_text(omni):
    both = omni.run(speak()).outputs[0]
    audio = omni.run(speak(modalities=(OutputModality.AUDIO,))).outputs[0]
    assert audio.text is None
    assert np.array_equal(audio.audio, both.audio)


def test_the_default_is_text_and_audio_in_chelsies_voice(omni):
    resolved = omni.resolve(speak())
    assert resolved.modalities == (OutputModality.TEXT, OutputModality.AUDIO)
    assert resolved.parameters["voice"] == "Chelsie"
    assert omni.family.voices(omni.model.path) == ("Chelsie", "Ethan")
    default = omni.run(speak()).outputs[0].audio
    assert np.array_equal(default, omni.run(speak(voice="Chelsie")).outputs[0].audio)


def test_the_two_voices_sound_different(omni):
    chelsie = omni.run(speak(voice="Chelsie")).outputs[0]
    ethan = omni.run(speak(voice="Ethan")).outputs[0]
    assert chelsie.text == ethan.text  # the voice changes the speech, not the words
    assert chelsie.audio.shape != ethan.audio.shape or not np.array_equal(chelsie.audio, ethan.audio)


def test_an_unknown_voice_is_refused_naming_the_voices(omni):
    with pytest.raises(RequestError) as info:
        omni.resolve(speak(voice="Bob"))
    assert info.value.field == "voice"
    assert "Bob" in info.value.message and "Chelsie, Ethan" in info.value.message


def test_a_voice_on_a_model_without_audio_is_refused(chat_engine):
    with pytest.raises(RequestError) as info:
        chat_engine.resolve(GenerationRequest("hi", GenerationParams(voice="Chelsie")))
    assert info.value.field == "voice" and "no audio" in info.value.message


def test_speed_stretches_the_utterance_and_keeps_its_words(omni):
    """``speed`` (engine/tempo.py) on the whole render: the same speech, stretched, recorded."""
    spoken = omni.run(speak()).outputs[0]
    events = events_of(omni, speak(speed=2.0))
    fast = events[-1].outputs[0]
    assert fast.text == spoken.text  # the tempo changes the sound, not the words
    assert np.array_equal(fast.audio, stretch(spoken.audio, 2.0))
    assert fast.audio.size == round(spoken.audio.size / 2) + SLACK
    assert np.array_equal(
        np.concatenate([e.samples for e in events if isinstance(e, AudioDelta)]), fast.audio
    )
    assert omni.resolve(speak(speed=2.0)).parameters["speed"] == 2.0
    assert "speed" not in omni.resolve(speak()).parameters  # as spoken: nothing recorded, nothing changed


@pytest.mark.parametrize(
    ("speed", "modalities", "words"),
    [
        (5.0, None, "from 0.25 to 4"),
        (0.1, None, "from 0.25 to 4"),
        ("fast", None, "a number"),
        (2.0, (OutputModality.TEXT,), "no audio"),
    ],
)
def test_a_bad_speed_is_refused_naming_the_field(omni, speed, modalities, words):
    with pytest.raises(RequestError) as info:
        omni.resolve(speak(speed=speed, modalities=modalities))
    assert info.value.field == "speed" and words in info.value.message


def test_speed_on_a_model_without_audio_is_refused(chat_engine):
    with pytest.raises(RequestError) as info:
        chat_engine.resolve(GenerationRequest("hi", GenerationParams(speed=1.5)))
    assert info.value.field == "speed" and "no audio" in info.value.message


@pytest.mark.parametrize("field", ["height", "negative_prompt"])
def test_image_fields_do_not_apply_to_speech(omni, field):
    with pytest.raises(RequestError) as info:
        omni.resolve(speak(**{field: 64 if field == "height" else "x"}))
    assert info.value.field == field


def test_same_request_and_seed_give_the_same_samples_alone_and_among_eight(omni):
    alone = omni.run(speak(seed=11)).outputs[0]
    requests = [
        speak(seed=11) if i == 3 else speak(seed=20 + i, voice="Ethan" if i % 2 else None) for i in range(8)
    ]
    results: dict[int, RunFinished] = {}

    def run(i: int) -> None:
        results[i] = omni.run(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 8
    crowded = results[3].outputs[0]
    assert crowded.text == alone.text
    assert np.array_equal(crowded.audio, alone.audio)
    assert len({results[i].outputs[0].audio.tobytes() for i in range(8)}) > 1


def test_a_copied_checkpoint_folder_loads_as_a_local_model(omni, tmp_path, session_data_dir):
    """The real-folder path: the built files copied elsewhere are detected as qwen-omni by their
    config.json and served by the same stages, with the same samples."""
    folder = tmp_path / "Qwen2.5-Omni-tiny"
    shutil.copytree(omni.model.path, folder)
    engine = build_engine(str(folder), WHOLE_RENDER, data_dir=session_data_dir)
    try:
        assert engine.family.name == "qwen-omni" and not engine.model.builtin
        local = engine.run(speak(voice="Ethan")).outputs[0]
    finally:
        engine.close()
    builtin = omni.run(speak(voice="Ethan")).outputs[0]
    assert local.text == builtin.text
    assert np.array_equal(local.audio, builtin.audio)


def test_cancel_during_the_thinker_stops_the_request_before_any_speech(omni):
    """Cancelled from the first token's event (on the thinker's own thread, so before its next token):
    the request ends cancelled and neither the talker nor code2wav runs."""
    events: list = []
    done = threading.Event()

    def sink(event) -> None:
        events.append(event)
        if isinstance(event, TokenProgress | TextDelta) and len(events) < 50:
            omni.cancel(event.request_id)
        if isinstance(event, RunFinished | RunFailed):
            done.set()

    omni.submit(omni.resolve(speak(seed=5)), sink)
    assert done.wait(timeout=300)
    assert isinstance(events[-1], RunFailed) and events[-1].cancelled
    assert [e.stage_id for e in events if isinstance(e, StageStarted)] == [0]
    assert not [e for e in events if isinstance(e, AudioDelta)]
