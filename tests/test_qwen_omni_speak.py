"""qwen-omni speaking given text (``speak_text``) and hearing audio (``input_audio``), on tiny-qwen-omni.

docs/speech.md, "Speaking given text and audio in": a speak_text request's thinker is teacher-forced with
the text as its reply, so its audio is the audio of a request whose thinker happened to say those words;
audio clips reach the thinker through the folder's Whisper feature extractor, laid out as transformers'
Qwen2.5-Omni processor lays them out, so the split engine equals the one-shot ``generate`` on them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    WhisperFeatureExtractor,
)

from engine import ChatTurn, GenerationParams, GenerationRequest, RequestError
from engine.engine import OmniEngine, build_engine
from engine.events import FinishReason, StageFinished
from engine.modality import OutputModality
from engine.pipelines.qwen_omni import SPEECH_SYSTEM_PROMPT, chat_messages
from tests.conftest import tiny_deploy
from tests.qwen_omni_reference import THINKER_MAX, generate_one_shot

PROMPT = "say hello"
SYSTEM = (ChatTurn("system", SPEECH_SYSTEM_PROMPT),)  # the speaking prompt, given explicitly


@pytest.fixture(scope="module")
def omni(session_data_dir) -> Iterator[OmniEngine]:
    engine = build_engine(
        "tiny-qwen-omni",
        tiny_deploy("tiny-qwen-omni", stage2={"chunk_size": None}),
        data_dir=session_data_dir,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(omni):
    return AutoTokenizer.from_pretrained(omni.model.path)


def clip(seconds: float, seed: int) -> np.ndarray:
    """A deterministic 16 kHz float32 clip: a gliding tone under some noise (what decode_input_audio gives)."""
    t = np.arange(int(seconds * 16_000)) / 16_000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.05 * noise).astype(np.float32)


def request(prompt: str = PROMPT, **fields) -> GenerationRequest:
    params = fields.pop("params", None) or GenerationParams(seed=7)
    return GenerationRequest(prompt, params, **fields)


# -- speaking given text ---------------------------------------------------------------------------


def a_reply_that_ends(omni, tokenizer, temperature: float) -> tuple[int, str]:
    """A seed whose thinker (on the speaking prompt) ends its reply by itself, in text that tokenizes back
    to the same ids. The tiny thinker rarely ends (docs/speech.md, "The tiny model"), hence the search."""
    for seed in range(1, 200):
        params = GenerationParams(seed=seed, max_tokens=40, temperature=temperature)
        output = omni.run(request(history=SYSTEM, params=params, modalities=(OutputModality.TEXT,))).outputs[
            0
        ]
        ids = tokenizer(output.text or "", add_special_tokens=False)["input_ids"]
        if output.finish_reason == FinishReason.STOP and output.output_tokens == len(ids) + 1 and ids:
            return seed, output.text or ""
    raise AssertionError("no seed made a reply that ends within 40 tokens")


def test_speak_text_sounds_like_a_reply_that_said_it(omni, tokenizer):
    """A normal request's reply text, asked again as speak_text with the same seed: the same samples."""
    seed, said = a_reply_that_ends(omni, tokenizer, temperature=1.5)
    params = GenerationParams(seed=seed, max_tokens=40, temperature=1.5)
    normal = omni.run(request(history=SYSTEM, params=params)).outputs[0]
    assert normal.text == said and normal.audio is not None and normal.audio.size > 0
    spoken = omni.run(request(history=SYSTEM, params=params, speak_text=said)).outputs[0]
    assert spoken.text == said
    assert spoken.finish_reason == FinishReason.STOP
    assert np.array_equal(spoken.audio, normal.audio)
    # Without a system turn the speaking prompt is the same one (the thinker adds it).
    assert np.array_equal(omni.run(request(params=params, speak_text=said)).outputs[0].audio, normal.audio)


def test_different_texts_give_different_audio_and_the_text_is_the_output(omni):
    texts = ["hello there, how are you.", "Good night! <|im_end|> ünïcødé 你好"]
    outputs = [omni.run(request("", speak_text=text)).outputs[0] for text in texts]
    for text, output in zip(texts, outputs, strict=True):
        assert output.text == text  # special-token names are spoken as plain text
        assert output.audio is not None and output.audio.size > 0
    assert not np.array_equal(outputs[0].audio, outputs[1].audio)
    again = omni.run(request("", speak_text=texts[0])).outputs[0]
    assert np.array_equal(again.audio, outputs[0].audio)


def test_speak_text_is_not_bounded_by_max_tokens_and_streams_its_text(omni):
    text = "a reply longer than the preset's twenty four thinker tokens."
    events = list(omni.stream(omni.resolve(request("speak slowly", speak_text=text))))
    finished = events[-1]
    assert finished.outputs[0].text == text
    thinker = next(e for e in events if isinstance(e, StageFinished) and e.stage_id == 0)
    assert thinker.output_tokens == len(text) + 1 > THINKER_MAX  # one byte a token, then <|im_end|>


def test_instructions_change_the_speech_not_the_words(omni):
    plain = omni.run(request("", speak_text="good morning.")).outputs[0]
    told = omni.run(request("whisper it", speak_text="good morning.")).outputs[0]
    assert plain.text == told.text == "good morning."
    assert not np.array_equal(plain.audio, told.audio)


def test_speak_text_with_text_only_runs_the_thinker_and_returns_the_text(omni):
    events = list(
        omni.stream(omni.resolve(request(speak_text="just text.", modalities=(OutputModality.TEXT,))))
    )
    output = events[-1].outputs[0]
    assert output.text == "just text." and output.audio is None
    assert {e.stage_id for e in events if isinstance(e, StageFinished)} == {0}


def test_speak_text_is_recorded_in_the_parameters(omni):
    resolved = omni.resolve(request(speak_text="hi."))
    assert resolved.parameters["speak_text"] == "hi."
    assert "speak_text" not in omni.resolve(request()).parameters


# -- audio in ----------------------------------------------------------------------------------------


def test_a_clip_changes_the_reply_and_the_same_clip_and_seed_repeat_exactly(omni):
    without = omni.run(request()).outputs[0]
    heard = omni.run(request(input_audio=(clip(1.5, 1),))).outputs[0]
    again = omni.run(request(input_audio=(clip(1.5, 1),))).outputs[0]
    assert heard.text and heard.text != without.text
    assert heard.text == again.text and np.array_equal(heard.audio, again.audio)
    resolved = omni.resolve(request(input_audio=(clip(1.5, 1), clip(0.5, 2))))
    assert resolved.parameters["input_audio_clips"] == 2
    json.dumps(resolved.parameters)  # recorded as JSON: the clips themselves are not in it


def test_what_the_clip_holds_is_heard_not_only_its_length(omni):
    """A tone and noise of the same length: the tiny thinker's replies part for some seed (its random
    audio encoder barely moves its logits, so not for every seed)."""
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24_000) / 16_000)).astype(np.float32)
    noise = (0.3 * np.random.default_rng(0).standard_normal(24_000)).astype(np.float32)
    texts = [
        tuple(
            omni.run(request(params=GenerationParams(seed=seed), input_audio=(heard,))).outputs[0].text
            for heard in (tone, noise)
        )
        for seed in range(1, 6)
    ]
    assert any(a != b for a, b in texts), texts


def qwen_omni_processor(path) -> Qwen2_5OmniProcessor:
    """transformers' own Qwen2.5-Omni processor over the folder's tokenizer and Whisper extractor, for its
    audio layout. Built without ``__init__``: its constructor checks the video processor's class, which
    needs torchvision (not installed); images and videos are not used here."""
    names = {
        "audio_token": "<|AUDIO|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
    }
    processor = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)
    processor.tokenizer = AutoTokenizer.from_pretrained(path, extra_special_tokens=names)
    processor.feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
    processor.image_processor = processor.video_processor = SimpleNamespace(merge_size=2)
    for name, token in names.items():
        setattr(processor, name, token)
    return processor


@pytest.mark.parametrize(("seed", "voice", "temperature"), [(1, "Chelsie", 0.8), (3, "Ethan", 0)])
def test_split_engine_with_audio_in_equals_the_one_shot_generate(omni, seed, voice, temperature):
    """Two clips and text in the user turn: the split engine's text and samples are transformers'
    one-shot ``generate`` on the library processor's inputs, sample for sample."""
    clips = (clip(1.2, 3), clip(0.7, 4))
    params = GenerationParams(seed=seed, voice=voice, temperature=temperature)
    events = list(omni.stream(omni.resolve(request(params=params, input_audio=clips))))
    output = events[-1].outputs[0]

    path = omni.model.path
    processor = qwen_omni_processor(path)
    messages = chat_messages([ChatTurn("user", PROMPT)], speak=True, audio_clips=len(clips))
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, audio=list(clips), return_tensors="pt")
    thinker = next(e for e in events if isinstance(e, StageFinished) and e.stage_id == 0)
    assert thinker.input_tokens == inputs["input_ids"].shape[1]  # the same placeholders
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    sequences, wave = generate_one_shot(model, inputs, seed=seed, voice=voice, temperature=temperature)
    reply = processor.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert output.text == reply and reply
    assert np.array_equal(output.audio, wave.numpy())


def test_speak_text_and_audio_in_together(omni):
    heard = omni.run(request("repeat after me", speak_text="ok.", input_audio=(clip(1.0, 5),))).outputs[0]
    plain = omni.run(request("repeat after me", speak_text="ok.")).outputs[0]
    assert heard.text == plain.text == "ok."
    assert not np.array_equal(heard.audio, plain.audio)  # what the thinker heard conditions the talker


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"input_audio": (clip(0.5, 1).astype(np.float64),)}, "1-D float32"),
        ({"input_audio": (np.zeros((2, 8000), np.float32),)}, "1-D float32"),
        ({"input_audio": ([0.0] * 8000,)}, "list"),
        ({"input_audio": [clip(0.5, 1)]}, "tuple"),
        ({"input_audio": (np.full(8000, np.nan, np.float32),)}, "NaN"),
        ({"input_audio": (np.zeros(320, np.float32),)}, "at least 321"),
    ],
)
def test_wrong_audio_is_refused_naming_input_audio(omni, fields, needle):
    with pytest.raises(RequestError) as caught:
        omni.resolve(request(**fields))
    assert caught.value.field == "input_audio" and needle in caught.value.message


def test_speak_text_of_the_wrong_type_is_refused(omni):
    with pytest.raises(RequestError) as caught:
        omni.resolve(request(speak_text=b"bytes"))  # type: ignore[arg-type]
    assert caught.value.field == "speak_text"


def test_a_model_without_audio_input_refuses_audio_and_speak_text(chat_engine):
    with pytest.raises(RequestError) as caught:
        chat_engine.resolve(GenerationRequest("hi", input_audio=(clip(0.5, 1),)))
    assert caught.value.field == "input_audio" and "does not take audio input" in caught.value.message
    with pytest.raises(RequestError) as caught:
        chat_engine.resolve(GenerationRequest("", speak_text="hello"))
    assert caught.value.field == "speak_text"
