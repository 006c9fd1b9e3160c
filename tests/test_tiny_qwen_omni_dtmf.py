"""The trained built-in `tiny-qwen-omni-dtmf`: asked to dial, it replies the keys and speaks their DTMF tones.

This is the speech path's regression check (docs/tiny-qwen-omni-dtmf.md): a talker conditioned on the
wrong rows, codes handed over in the wrong order, chunks stitched at the wrong offsets or batched rows
mixed up all change which keys a Goertzel decoder hears. The 500-sequence evaluation is
bench/dtmf_eval.py; here a few dials, each way, streamed and whole, alone and eight at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from engine import GenerationParams, GenerationRequest, RunFinished
from engine.engine import OmniEngine, build_engine
from engine.modality import OutputModality
from engine.models import describe_model, model_card
from engine.tiny import BUILTIN_MODELS, ensure_builtin_model
from tests.conftest import tiny_deploy
from tools.dtmf.decode import COLUMNS, ROWS, decode, presses, synthetic
from tools.dtmf.world import held_out

MODEL = "tiny-qwen-omni-dtmf"
DEADLINE_S = 300  # bounds a hang only
# Fixed dials: held-out sequences (never trained on: "* 0", "6 5 0 7", "# 4 2 4 1 0 8 8 3 6") and training
# ones, one to ten keys, repeated keys, * and #.
DIALS = ["4 1 7", "* 0", "5 5 5 0 1 2 3", "6 5 0 7", "# 4 2 4 1 0 8 8 3 6", "0"]


@pytest.fixture(scope="module")
def streamed(session_data_dir) -> Iterator[OmniEngine]:
    engine = build_engine(MODEL, data_dir=session_data_dir)  # the deploy default: code2wav streams
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def whole(session_data_dir) -> Iterator[OmniEngine]:
    engine = build_engine(MODEL, tiny_deploy(MODEL, stage2={"chunk_size": None}), data_dir=session_data_dir)
    yield engine
    engine.close()


def chat(keys: str, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        f"dial {keys}", GenerationParams(seed=seed), modalities=(OutputModality.TEXT, OutputModality.AUDIO)
    )


def speech(keys: str, seed: int = 0) -> GenerationRequest:
    """What /v1/audio/speech sends for ``input: keys`` (studio/runs/speech.py)."""
    return GenerationRequest(
        keys, GenerationParams(seed=seed), modalities=(OutputModality.AUDIO,), speak_text=keys
    )


def test_the_decoder_hears_dials_and_nothing_else():
    for i, keys in enumerate(DIALS):
        assert decode(synthetic(keys, snr_db=10.0, seed=i)) == keys
    t = np.arange(24_000) / 24_000
    assert decode(np.random.default_rng(0).normal(0, 0.3, 24_000)) == ""
    for freq in ROWS + COLUMNS:
        assert decode(0.5 * np.sin(2 * np.pi * freq * t)) == ""
    assert decode(np.zeros(24_000)) == ""


def test_shipped_model_is_registered_small_and_in_the_real_layout(model_cache):
    model = BUILTIN_MODELS[MODEL]
    assert model.shipped and describe_model(MODEL).family.name == "qwen-omni"
    path = ensure_builtin_model(MODEL, model_cache)
    assert path == model.shipped_path
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
        "spk_dict.pt",
    ):
        assert (path / name).is_file(), name
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 10 * 2**20, size
    assert model_card(describe_model(MODEL)).example_prompt == "dial 5 5 5 0 1 2 3"
    assert [held_out(d.split()) for d in DIALS].count(True) == 3  # half the dials were never trained on


@pytest.mark.parametrize("keys", DIALS)
def test_a_chat_dial_replies_the_keys_and_speaks_their_tones(streamed, keys):
    output = streamed.run(chat(keys, seed=3)).outputs[0]
    assert output.text == keys
    assert output.sample_rate == 24_000
    heard = presses(output.audio)
    assert " ".join(p.key for p in heard) == keys
    # ~100 ms tones, ~60 ms apart
    for press in heard:
        assert 0.07 <= press.end_s - press.start_s <= 0.13, press
    for a, b in zip(heard, heard[1:], strict=False):
        assert 0.14 <= b.start_s - a.start_s <= 0.18, (a, b)


@pytest.mark.parametrize("keys", DIALS[:4])
def test_the_speech_endpoint_speaks_the_same_tones(streamed, keys):
    output = streamed.run(speech(keys, seed=5)).outputs[0]
    assert decode(output.audio) == keys


def test_a_streamed_dial_decodes_as_the_whole_render(streamed, whole):
    keys = DIALS[4]
    chunks = streamed.run(chat(keys, seed=7)).outputs[0].audio
    at_once = whole.run(chat(keys, seed=7)).outputs[0].audio
    assert decode(chunks) == decode(at_once) == keys
    assert chunks.size == at_once.size


def test_eight_concurrent_dials_decode_right_and_equal_their_alone_samples(streamed):
    keys = ["1 2 3", "4 5 6", "7 8 9", "* 0 #", "9 9", "3 1 4 1 5", "2 7 1 8", "#"]
    requests = [speech(k, seed=40 + i) for i, k in enumerate(keys)]
    alone = [streamed.run(r).outputs[0] for r in requests]
    crowded: list[object] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def one(i: int) -> None:
        start.wait(DEADLINE_S)
        crowded[i] = streamed.run(requests[i]).outputs[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    for k, a, c in zip(keys, alone, crowded, strict=True):
        assert decode(a.audio) == k
        assert np.array_equal(a.audio, c.audio)  # type: ignore[attr-defined]


def test_prompts_it_was_not_trained_on_run_with_a_warning(streamed):
    assert streamed.resolve(chat("4 1 7")).warnings == ()
    assert streamed.resolve(speech("4 1 7")).warnings == ()
    (warning,) = streamed.resolve(GenerationRequest("sing me a song", GenerationParams(seed=0))).warnings
    assert "tiny-qwen-omni-dtmf answers prompts that match" in warning
    assert "'dial 5 5 5 0 1 2 3'" in warning and "'sing me a song'" in warning
    (warning,) = streamed.resolve(speech("dial 4 1 7")).warnings  # the speech input is the keys alone
    assert "speaks texts that match" in warning and "'dial 4 1 7'" in warning
    # Still runs: the engine answers, whatever it makes of it.
    events = list(streamed.stream(streamed.resolve(GenerationRequest("sing", GenerationParams(seed=0)))))
    assert isinstance(events[-1], RunFinished)


def test_a_card_pattern_that_is_not_a_regular_expression_is_refused_naming_it():
    from engine.models import ModelCard

    with pytest.raises(ValueError, match="prompt_pattern is not a regular expression"):
        ModelCard.parse({"prompt_pattern": "dial ("})
