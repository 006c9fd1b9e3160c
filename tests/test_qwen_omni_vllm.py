"""The qwen-omni thinker on vLLM (``backend: vllm``, text-only requests): greedy parity with transformers.

vLLM's CPU attention takes head sizes of 32 and more, and the built-in tiny-qwen-omni's thinker has 16,
so the parity tests build the same recipe with a head size of 32 (two heads of hidden 64) into a folder
of the real checkpoint's layout and serve it as a local model (docs/speech.md, "vLLM for the thinker").
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vLLM through scripts/setup.sh test: a missing one is a failure)
else:
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh test")

from engine import GenerationParams, GenerationRequest  # noqa: E402
from engine.engine import EngineBuildError, OmniEngine, build_engine  # noqa: E402
from engine.events import ErrorType, RunFailed, RunOutput  # noqa: E402
from engine.modality import OutputModality  # noqa: E402
from engine.pipelines.qwen_omni.thinker import ThinkerStage  # noqa: E402
from engine.pipelines.qwen_omni.thinker_vllm import VllmThinkerStage  # noqa: E402
from engine.request import ChatTurn  # noqa: E402
from engine.tiny import BUILTIN_MODELS  # noqa: E402
from engine.tiny.qwen_omni import build  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = ["say hello", "what is two and two", "tell me a story about a cat", "ok"]
TEXT = (OutputModality.TEXT,)


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory):
    cache = os.environ.get("OMNI_STUDIO_MODEL_CACHE") or os.environ.get("OMNI_STUDIO_TEST_MODEL_CACHE")
    path = Path(cache) if cache else tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_STUDIO_MODEL_CACHE", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        # Both backends on one intra-op thread, so reductions round alike (tests/test_ar_vllm.py).
        patch.setenv("OMP_NUM_THREADS", "1")
        yield path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-qwen-omni's recipe with the thinker's head size 32 (M-RoPE sections summing to 16)."""
    recipe = BUILTIN_MODELS["tiny-qwen-omni"].recipe()
    recipe["thinker"].update(num_attention_heads=2, num_key_value_heads=1, mrope_section=[4, 6, 6])
    out = tmp_path_factory.mktemp("omni-head32") / "Qwen2.5-Omni-head32"
    build(recipe, out)
    return out


def thinker_on(backend: str, folder: Path, data_dir: Path) -> OmniEngine:
    return build_engine(
        str(folder), {"stages": [{"stage_id": 0, "backend": backend, "max_num_seqs": 4}]}, data_dir=data_dir
    )


@pytest.fixture(scope="module")
def on_vllm(folder: Path, data_dir: Path):
    engine = thinker_on("vllm", folder, data_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def on_transformers(folder: Path, data_dir: Path):
    engine = thinker_on("transformers", folder, data_dir)
    yield engine
    engine.close()


def text_request(prompt: str, max_tokens: int = 48, **params) -> GenerationRequest:
    return GenerationRequest(
        prompt, GenerationParams(seed=1, temperature=0.0, max_tokens=max_tokens, **params), modalities=TEXT
    )


def finished(engine: OmniEngine, request: GenerationRequest) -> RunOutput:
    return engine.run(request).outputs[0]


def failure(engine: OmniEngine, request: GenerationRequest) -> RunFailed:
    events = list(engine.stream(engine.resolve(request)))
    assert isinstance(events[-1], RunFailed), events[-1]
    return events[-1]


def test_the_backends_are_the_ones_asked_for(on_vllm, on_transformers):
    assert isinstance(on_vllm.runners[0], VllmThinkerStage)
    assert isinstance(on_transformers.runners[0], ThinkerStage)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_transformers_thinkers(on_vllm, on_transformers, prompt):
    ours = finished(on_vllm, text_request(prompt))
    reference = finished(on_transformers, text_request(prompt))
    assert ours.text == reference.text
    assert ours.text  # the tiny thinker's readable ids make visible text
    assert ours.output_tokens == reference.output_tokens
    assert ours.finish_reason == reference.finish_reason


def test_a_long_reply_and_a_conversation_stay_equal(on_vllm, on_transformers):
    long = text_request("tell me everything", max_tokens=400)
    ours, theirs = finished(on_vllm, long), finished(on_transformers, long)
    assert ours.text == theirs.text and ours.output_tokens == theirs.output_tokens
    history = (ChatTurn("user", "say hello"), ChatTurn("assistant", "hello there"))
    turn = GenerationRequest(
        "and again",
        GenerationParams(seed=1, temperature=0.0, max_tokens=48),
        history=history,
        modalities=TEXT,
    )
    ours, theirs = finished(on_vllm, turn), finished(on_transformers, turn)
    assert ours.text == theirs.text and ours.input_tokens == theirs.input_tokens > 20


def test_four_at_once_give_what_each_gives_alone(on_vllm):
    alone = [finished(on_vllm, text_request(p)).text for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: finished(on_vllm, text_request(p)).text, PROMPTS))
    assert together == alone


@pytest.mark.parametrize(
    ("modalities", "extra", "field"),
    [
        (None, {}, "modalities"),  # the family's default, text + audio
        ((OutputModality.AUDIO,), {}, "modalities"),
        (TEXT, {"speak_text": "hi"}, "speak_text"),
    ],
)
def test_speech_on_the_vllm_thinker_is_refused_naming_the_field(on_vllm, modalities, extra, field):
    request = GenerationRequest("say hello", GenerationParams(seed=1), modalities=modalities, **extra)
    failed = failure(on_vllm, request)
    assert failed.error_type == ErrorType.INVALID_REQUEST
    assert field in failed.message and "backend: transformers" in failed.message
    assert finished(on_vllm, text_request("ok")).text  # the stage still serves


def test_the_builtin_models_head_size_is_refused_at_start_saying_why(data_dir):
    with pytest.raises(EngineBuildError) as refused:
        build_engine("tiny-qwen-omni", {"stages": [{"stage_id": 0, "backend": "vllm"}]}, data_dir=data_dir)
    message = str(refused.value)
    assert "head size is 16" in message and "32" in message and "backend: transformers" in message


def test_the_talker_on_vllm_is_refused_saying_why(data_dir):
    with pytest.raises(EngineBuildError) as refused:
        build_engine("tiny-qwen-omni", {"stages": [{"stage_id": 1, "backend": "vllm"}]}, data_dir=data_dir)
    assert "no Qwen2.5-Omni talker" in str(refused.value)
