"""AR stages on vLLM: greedy parity with transformers, streaming, continuous batching, cancellation.

Each vLLM engine starts once per module (in-process, eager: a few seconds on the tiny models). Built-in
models are built once into ``$OMNI_STUDIO_MODEL_CACHE`` (``scripts/test.sh`` points it at a cache in
``.venv``), so every test and the CLI subcommand share them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vLLM through scripts/setup.sh test: a missing one is a failure)
else:
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh test")

from engine import GenerationParams, GenerationRequest  # noqa: E402
from engine.engine import EngineBuildError, OmniEngine, build_engine  # noqa: E402
from engine.events import RunFailed, RunFinished, StageFinished, TextDelta, TokenProgress  # noqa: E402
from engine.modality import OutputAccumulator, OutputModality  # noqa: E402
from engine.pipelines.chat import ChatARStage  # noqa: E402
from engine.pipelines.chat.ar_vllm import VllmChatARStage  # noqa: E402
from engine.pipelines.glm_image import GlmImageARStage  # noqa: E402
from engine.pipelines.glm_image.ar_vllm import VllmGlmImageARStage  # noqa: E402
from engine.stages.base import StageJob  # noqa: E402
from engine.stages.vllm_drivers import serving_threads  # noqa: E402
from engine.stages.vllm_requests import VllmPrompt, sampling_params  # noqa: E402

pytestmark = pytest.mark.vllm


# Parity between the two AR backends compares them on the same intra-op thread count, one: the
# transformers stage runs a small model on one thread whatever the machine (engine/stages/base.py,
# docs/batching.md "One intra-op thread per small-model stage"), and an in-process vLLM engine serves on
# `OMP_NUM_THREADS` threads, else one (engine.stages.vllm_drivers.serving_threads, docs/vllm.md). Reductions
# over another thread count round differently and can flip a near-tie in the random logits, so the
# module pins OMP_NUM_THREADS=1 (model_cache below) instead of inheriting it from the shell, and each
# parity test checks both sides' count (same_thread_count). Given equal ids, the DiT stage is the same
# code on the same thread count and seed, so the pictures' bytes follow.
def glm_token_output_deploy() -> dict[str, Any]:
    """The tiny preset (64x64, 4 steps) with stage 0's ids also in the result and 4 sequences at once."""
    import yaml

    from engine.paths import DEPLOY_PRESETS_DIR

    deploy = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-image.yaml").read_text())
    deploy["stages"][0].update(max_num_seqs=4, final_output=True, final_output_type="token_ids")
    return deploy


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build of the tiny models for the module (and the CLI runs it starts)."""
    cache = os.environ.get("OMNI_STUDIO_MODEL_CACHE") or os.environ.get("OMNI_STUDIO_TEST_MODEL_CACHE")
    path = Path(cache) if cache else tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_STUDIO_MODEL_CACHE", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("OMP_NUM_THREADS", "1")  # vLLM serves on the transformers stage's count (above)
        yield path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def glm_vllm(model_cache: Path, data_dir: Path) -> OmniEngine:
    engine = build_engine("tiny-glm-image", glm_token_output_deploy(), data_dir=data_dir, ar_backend="vllm")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def glm_transformers(model_cache: Path, data_dir: Path) -> OmniEngine:
    engine = build_engine(
        "tiny-glm-image", glm_token_output_deploy(), data_dir=data_dir, ar_backend="transformers"
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_auto(model_cache: Path, data_dir: Path) -> OmniEngine:
    """tiny-chat with its default deploy config (max_num_seqs 8) and backend auto (the preset pins
    transformers for a fast CPU start; --ar-backend auto overrides it)."""
    engine = build_engine("tiny-chat", data_dir=data_dir, ar_backend="auto")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_transformers(model_cache: Path, data_dir: Path) -> OmniEngine:
    engine = build_engine("tiny-chat", data_dir=data_dir, ar_backend="transformers")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_one_slot(model_cache: Path, data_dir: Path) -> OmniEngine:
    """One sequence at a time, never stopping at EOS: a request runs until cancelled or max_tokens."""
    deploy = {
        "stages": [
            {
                "stage_id": 0,
                "max_num_seqs": 1,
                "max_model_len": 2048,
                "default_sampling_params": {"max_tokens": 64, "ignore_eos": True, "temperature": 0.0},
            }
        ]
    }
    engine = build_engine("tiny-chat", deploy, data_dir=data_dir, ar_backend="vllm")
    yield engine
    engine.close()


def same_thread_count(transformers_engine: OmniEngine) -> None:
    """Both AR backends compute on one intra-op thread: vLLM's serving count and the transformers AR
    stage's (the module's note above). The DiT stage is the same runner on both engines, so it runs on
    the same count on both sides by construction."""
    assert (serving_threads(), transformers_engine.runners[0].intra_op_threads) == (1, 1)


def run(engine: OmniEngine, prompt: str, image: Image.Image | None = None, **params: Any) -> RunFinished:
    params.setdefault("seed", 7)
    return engine.run(GenerationRequest(prompt, GenerationParams(**params), image=image))


def png_digest(image: Image.Image) -> str:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def source_image() -> Image.Image:
    gradient = torch.linspace(0, 255, 64).to(torch.uint8)
    pixels = torch.stack(
        [gradient.expand(64, 64), gradient.expand(64, 64).T, torch.full((64, 64), 90, dtype=torch.uint8)], -1
    )
    return Image.fromarray(pixels.numpy(), "RGB")


# -- GLM-Image ------------------------------------------------------------------------------------


def test_backend_choice(glm_vllm: OmniEngine, glm_transformers: OmniEngine, chat_auto: OmniEngine) -> None:
    assert isinstance(glm_vllm.runners[0], VllmGlmImageARStage)
    assert isinstance(glm_transformers.runners[0], GlmImageARStage)
    assert isinstance(chat_auto.runners[0], VllmChatARStage)  # auto picks vLLM when it imports


@pytest.mark.parametrize(("height", "width"), [(64, 64), (64, 128), (128, 64)])
def test_glm_image_greedy_ids_and_image_match_transformers(
    glm_vllm: OmniEngine, glm_transformers: OmniEngine, height: int, width: int
) -> None:
    same_thread_count(glm_transformers)
    prompt = f"a lighthouse on a cliff, {height}x{width}"
    ours = run(glm_vllm, prompt, height=height, width=width, temperature=0.0).outputs[0]
    reference = run(glm_transformers, prompt, height=height, width=width, temperature=0.0).outputs[0]
    # preview grid (T2I), then the target grid, then the end token: exactly what ar2diffusion expects
    ph, pw = (16, 16) if height == width else ((22, 11) if height > width else (11, 22))
    assert len(ours.token_ids) == ph * pw + (height // 32) * (width // 32) + 1
    assert ours.token_ids == reference.token_ids
    assert png_digest(ours.images[0]) == png_digest(reference.images[0])


def test_glm_image_i2i_matches_transformers(glm_vllm: OmniEngine, glm_transformers: OmniEngine) -> None:
    same_thread_count(glm_transformers)
    image = source_image()
    ours = run(glm_vllm, "make it dusk", image=image, temperature=0.0).outputs[0]
    reference = run(glm_transformers, "make it dusk", image=image, temperature=0.0).outputs[0]
    assert len(ours.token_ids) == 2 * 2 + 1  # I2I: the target grid only (64x64 -> 2x2), then the end token
    assert ours.token_ids == reference.token_ids
    assert png_digest(ours.images[0]) == png_digest(reference.images[0])


def test_glm_image_concurrent_requests_match_one_by_one(
    glm_vllm: OmniEngine, glm_transformers: OmniEngine
) -> None:
    """Continuously batched (max_num_seqs 4) greedy requests give each request's solo result."""
    prompts = [f"prompt number {i}" for i in range(4)]
    results: dict[str, RunFinished] = {}

    def worker(prompt: str) -> None:
        results[prompt] = run(glm_vllm, prompt, temperature=0.0)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for prompt in prompts:
        assert (
            results[prompt].outputs[0].token_ids
            == run(glm_transformers, prompt, temperature=0.0).outputs[0].token_ids
        )


def test_glm_image_seeded_sampling_is_per_request(glm_vllm: OmniEngine) -> None:
    first = run(glm_vllm, "a fox", seed=11, temperature=1.0).outputs[0].token_ids
    again = run(glm_vllm, "a fox", seed=11, temperature=1.0).outputs[0].token_ids
    other = run(glm_vllm, "a fox", seed=12, temperature=1.0).outputs[0].token_ids
    assert first == again
    assert first != other


def test_cli_run_png_identical_across_backends(model_cache: Path, tmp_path: Path) -> None:
    from studio.cli import main

    # Both runs on one intra-op thread (the module's note above): vLLM by OMP_NUM_THREADS=1, the
    # transformers stages by their models' size, as in test_glm_image_greedy_ids_and_image_match_transformers.
    assert serving_threads() == 1
    outputs = {}
    for backend in ("vllm", "transformers"):
        out = tmp_path / f"{backend}.png"
        code = main(
            [
                "run",
                "a red boat at sea",
                "--out",
                str(out),
                "--seed",
                "5",
                "--temperature",
                "0",
                "--ar-backend",
                backend,
                "--data-dir",
                str(tmp_path / "data"),
                "--quiet",
            ]
        )
        assert code == 0
        outputs[backend] = Image.open(out)
    vllm, transformers = outputs["vllm"], outputs["transformers"]
    # The same picture, pixel for pixel; the files differ only where the recipe names the backend (its
    # config snapshot and hash, docs/recipes.md).
    assert vllm.tobytes() == transformers.tobytes()
    assert vllm.info["parameters"] == transformers.info["parameters"]
    recipes = [json.loads(image.info["omni_studio"]) for image in (vllm, transformers)]
    assert [r["config"]["stages"][0]["backend"] for r in recipes] == ["vllm", "transformers"]
    for recipe in recipes:
        del recipe["config"], recipe["config_hash"]
    assert recipes[0] == recipes[1]


# -- chat -------------------------------------------------------------------------------------------


def test_chat_streams_text_like_transformers(chat_auto: OmniEngine, chat_transformers: OmniEngine) -> None:
    request = GenerationRequest(
        "tell me about the river", GenerationParams(seed=3, temperature=0.0, max_tokens=40)
    )
    events = list(chat_auto.stream(chat_auto.resolve(request)))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert len(deltas) > 1  # streamed piece by piece
    assert "".join(deltas) == finished.outputs[0].text
    assert any(isinstance(e, TokenProgress) for e in events)
    reference = chat_transformers.run(request)
    assert finished.outputs[0].text == reference.outputs[0].text
    assert finished.outputs[0].output_tokens == reference.outputs[0].output_tokens


def test_eight_concurrent_chat_requests_complete(chat_auto: OmniEngine) -> None:
    events: dict[int, list] = {i: [] for i in range(8)}
    done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def sink_for(i: int):
        def sink(event) -> None:
            events[i].append(event)
            if isinstance(event, (RunFinished, RunFailed)):
                with lock:
                    finished.append(i)
                    if len(finished) == 8:
                        done.set()

        return sink

    for i in range(8):
        request = GenerationRequest(
            f"story {i} about a cat", GenerationParams(seed=i, max_tokens=48, temperature=0.8)
        )
        chat_auto.submit(chat_auto.resolve(request), sink_for(i))
    assert done.wait(120)
    for i in range(8):
        assert isinstance(events[i][-1], RunFinished), events[i][-1]
        assert events[i][-1].outputs[0].output_tokens > 0
    batch_sizes = [e.batch_size for evs in events.values() for e in evs if isinstance(e, StageFinished)]
    assert max(batch_sizes) > 1  # they ran together, not one after another


def test_cancelled_request_frees_its_slot(chat_one_slot: OmniEngine) -> None:
    long_request = GenerationRequest("a very long story", GenerationParams(max_tokens=1900))
    started = threading.Event()
    terminal: list = []

    def sink(event) -> None:
        if isinstance(event, TokenProgress) and event.step > 0:
            started.set()
        if isinstance(event, (RunFinished, RunFailed)):
            terminal.append(event)

    handle = chat_one_slot.submit(chat_one_slot.resolve(long_request), sink)
    assert started.wait(60)
    handle.cancel()
    began = time.monotonic()
    follow_up = chat_one_slot.run(GenerationRequest("a short one", GenerationParams(max_tokens=16)))
    assert follow_up.outputs[0].output_tokens == 16  # ignore_eos: it ran to max_tokens
    assert time.monotonic() - began < 30
    assert terminal and isinstance(terminal[0], RunFailed) and terminal[0].cancelled
    assert chat_one_slot.runners[0].driver.live == {}  # vLLM holds no request for it any more


def test_stop_ids_and_allowed_ids(chat_auto: OmniEngine, chat_transformers: OmniEngine) -> None:
    """Stage parameters reach vLLM: stop at a stop id like transformers; allowed ids restrict sampling."""
    ours, reference = chat_auto.runners[0], chat_transformers.runners[0]
    assert isinstance(reference, ChatARStage)
    base = {"seed": 1, "temperature": 0.0, "max_tokens": 30, "ignore_eos": True}
    free = run_job(ours, base)
    assert free == run_reference_job(reference, base)
    ids = ours.tokenizer.encode(free, add_special_tokens=False)  # word-level: text <-> ids round-trips
    stop_id = ids[5]
    stopped = run_job(ours, {**base, "stop_token_ids": [stop_id]})
    assert stopped == ours.decode(ids[: ids.index(stop_id) + 1])
    assert stopped == run_reference_job(reference, {**base, "stop_token_ids": [stop_id]})
    allowed = ours.tokenizer.convert_tokens_to_ids(["red", "green", "blue"])
    sampled = run_job(ours, {**base, "temperature": 1.0, "allowed_token_ids": allowed})
    assert set(sampled.split()) <= {"red", "green", "blue"}


def run_job(runner: VllmChatARStage, params: dict[str, Any]) -> str:
    """Submit one job straight to a vLLM runner, wait for it, return its text."""
    job = chat_job(params)
    result: list[str] = []
    finished = threading.Event()
    runner.submit(job, lambda status, error: (result.append(status), finished.set()))
    assert finished.wait(60) and result == ["succeeded"]
    return job.deliver_outputs()["text"]


def run_reference_job(runner: ChatARStage, params: dict[str, Any]) -> str:
    job = chat_job(params)
    runner.run([job])
    return job.deliver_outputs()["text"]


def chat_job(params: dict[str, Any]) -> StageJob:
    from engine.request import ChatTurn

    return StageJob(
        request_id=f"job-{time.monotonic_ns()}",
        index=0,
        inputs={"messages": [ChatTurn("user", "the cat sees a bird")]},
        params=params,
        emit=lambda event: None,
        accumulator=OutputAccumulator((OutputModality.TEXT,)),
    )


# -- start-up and parameters ------------------------------------------------------------------------


def test_a_vllm_start_failure_names_the_way_out(model_cache: Path, data_dir: Path) -> None:
    deploy = {"stages": [{"stage_id": 0, "kv_cache_memory_bytes": 1024}]}  # far too small for one sequence
    with pytest.raises(EngineBuildError) as failure:
        build_engine("tiny-chat", deploy, data_dir=data_dir, ar_backend="vllm")
    message = str(failure.value)
    assert "stage 0 (ar) failed to start" in message
    assert "vLLM" in message and "--ar-backend transformers" in message


def test_sampling_params_mapping() -> None:
    prompt = VllmPrompt(token_ids=[1, 2, 3], max_tokens=9)
    greedy = sampling_params(
        {"temperature": 0.0, "top_k": 40, "top_p": 0.5, "seed": 3}, prompt, defaults={"top_k": 40}
    )
    assert greedy.temperature == 0.0 and greedy.top_k in (0, -1) and greedy.top_p == 1.0
    assert greedy.max_tokens == 9 and greedy.seed == 3 and not greedy.detokenize
    sampled = sampling_params(
        {
            "temperature": 0.7,
            "top_k": 0,
            "min_tokens": 2,
            "stop_token_ids": [5],
            "ignore_eos": True,
            "repetition_penalty": 1.1,
            "allowed_token_ids": [7, 8],
            "seed": 4,
        },
        prompt,
        defaults={"temperature": 0.8, "top_k": 40},
    )
    assert sampled.temperature == 0.7 and sampled.top_k in (0, -1) and sampled.min_tokens == 2
    assert sampled.stop_token_ids == [5] and sampled.ignore_eos and sampled.repetition_penalty == 1.1
    assert sorted(sampled.allowed_token_ids) == [5, 7, 8]
    defaults = sampling_params({"seed": 1}, prompt, defaults={"temperature": 0.8, "top_k": 40})
    assert (
        defaults.temperature == 0.8 and defaults.top_k == 40
    )  # the model's generation config, like generate()


# -- through the API and with vLLM's AsyncLLM -------------------------------------------------------------


def test_serve_tiny_chat_on_vllm_streams_and_records_concurrent_runs(
    model_cache: Path, tmp_path: Path
) -> None:
    """`omni-studio serve --model tiny-chat --ar-backend vllm`: SSE text streaming; 8 concurrent requests
    complete and are recorded."""
    import httpx
    import openai

    from studio.store import RunFilter, open_store
    from tests.servers import running_server

    data = tmp_path / "data"
    with running_server(["serve", "--model", "tiny-chat", "--ar-backend", "vllm"], data) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "tell me about the river"}],
            stream=True,
            max_tokens=16,
            seed=1,
            temperature=0,
        )
        pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) >= 5
        statuses: list[int] = []

        def one(seed: int) -> None:
            response = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=120,
                json={
                    "model": "tiny-chat",
                    "messages": [{"role": "user", "content": f"concurrent {seed}"}],
                    "seed": seed,
                    "max_tokens": 32,
                },
            )
            statuses.append(response.status_code)

        threads = [threading.Thread(target=one, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
        assert statuses == [200] * 8
    store = open_store(None, data)
    try:
        runs = store.list_runs(RunFilter(status="succeeded", search="concurrent"), limit=100)
        assert sorted(r.prompt for r in runs) == sorted(f"concurrent {s}" for s in range(8))
        batches = [stage.batch_size for r in runs for stage in store.get_run(r.id).stages]
        assert max(batches) > 1  # continuous batching: some ran together
    finally:
        store.close()


def test_async_driver_streams_and_cancels(model_cache: Path, data_dir: Path) -> None:
    """The GPU default (AsyncLLM, engine core in a child process) behaves like the in-process driver."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_STUDIO_VLLM_DRIVER", "async")
        deploy = {
            "stages": [{"stage_id": 0, "max_num_seqs": 2, "default_sampling_params": {"ignore_eos": True}}]
        }
        engine = build_engine("tiny-chat", deploy, data_dir=data_dir, ar_backend="vllm")
    try:
        assert engine.runners[0].driver_name == "async"
        request = GenerationRequest(
            "the cat sees a bird", GenerationParams(seed=2, temperature=0.0, max_tokens=24)
        )
        events = list(engine.stream(engine.resolve(request)))
        assert isinstance(events[-1], RunFinished) and events[-1].outputs[0].output_tokens == 24
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == events[-1].outputs[0].text
        started = threading.Event()
        terminal: list = []

        def sink(event) -> None:
            if isinstance(event, TokenProgress) and event.step > 0:
                started.set()
            if isinstance(event, (RunFinished, RunFailed)):
                terminal.append(event)

        handle = engine.submit(
            engine.resolve(GenerationRequest("long", GenerationParams(max_tokens=1900))), sink
        )
        assert started.wait(60)
        handle.cancel()
        deadline = time.monotonic() + 30
        while not terminal and time.monotonic() < deadline:
            time.sleep(0.05)
        assert terminal and isinstance(terminal[0], RunFailed) and terminal[0].cancelled
        assert engine.runners[0].driver.live == {}
    finally:
        engine.close()


def test_trained_shapes_model_draws_the_same_pictures_on_vllm(model_cache: Path, data_dir: Path) -> None:
    """Pipeline-level parity with a model whose pictures mean something: the trained `tiny-glm-shapes`
    (greedy AR in its deploy preset) draws byte-identical, correct pictures on both AR backends."""
    import numpy as np

    from tests.test_tiny_glm_shapes import PROMPTS
    from tools.shapes.classify import classify
    from tools.shapes.world import parse_caption

    pictures: dict[str, list[str]] = {}
    for backend in ("vllm", "transformers"):
        engine = build_engine("tiny-glm-shapes", data_dir=data_dir, ar_backend=backend)
        try:
            if backend == "transformers":
                same_thread_count(engine)  # vLLM's side: serving_threads() (the module's note above)
            images = [
                engine.run(GenerationRequest(p, GenerationParams(seed=s))).images[0] for p, s in PROMPTS
            ]
        finally:
            engine.close()
        pictures[backend] = [png_digest(image) for image in images]
        if backend == "vllm":
            readings = [classify(np.asarray(image.convert("RGB"))) for image in images]
            right = [
                all(r.correct(parse_caption(p)).values()) for r, (p, _) in zip(readings, PROMPTS, strict=True)
            ]
            assert sum(right) >= len(PROMPTS) - 1, list(zip(PROMPTS, readings, strict=True))
    assert pictures["vllm"] == pictures["transformers"]
