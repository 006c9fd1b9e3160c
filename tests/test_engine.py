"""The engine on the tiny built-in models: two-stage GLM-Image parity, determinism, events, cancel, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from diffusers import GlmImagePipeline

from engine import (
    DiffusionStep,
    GenerationParams,
    GenerationRequest,
    RequestError,
    RunFailed,
    RunFinished,
    StageFinished,
    StageStarted,
    TextDelta,
    TokenProgress,
)
from engine.building import build_pipeline_config
from engine.config import StageTemplate
from engine.engine import EngineBuildError, OmniEngine
from engine.models import describe_model, materialize
from engine.paths import model_cache_dir
from tests.conftest import png


def t2i(prompt="a red 'cat'", **params) -> GenerationRequest:
    params.setdefault("seed", 42)
    return GenerationRequest(prompt, GenerationParams(**params))


def collect(engine, request):
    return list(engine.stream(engine.resolve(request)))


def test_same_seed_same_png_at_the_requested_size(glm_engine):
    a = glm_engine.run(t2i(height=96, width=64)).images[0]
    b = glm_engine.run(t2i(height=96, width=64)).images[0]
    c = glm_engine.run(t2i(height=96, width=64, seed=43)).images[0]
    assert a.size == (64, 96)
    assert png(a) == png(b)
    assert png(a) != png(c)


@pytest.fixture(scope="module")
def one_shot_pipeline(glm_engine):
    pipe = GlmImagePipeline.from_pretrained(glm_engine.model.path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Seeds and sizes whose one-shot bytes on 2 threads differ from those on 1 (1 and 7 at 64x96, 7 at
# 128x128) as well as one whose do not (1234).
@pytest.mark.parametrize(
    ("seed", "height", "width"), [(1234, 64, 96), (1, 64, 96), (7, 64, 96), (7, 128, 128)]
)
def test_two_stage_engine_is_byte_identical_to_the_one_shot_pipeline(
    glm_engine, one_shot_pipeline, seed, height, width
):
    """The one-shot call runs on the intra-op thread count the engine's stages use (one for these small
    models, docs/batching.md "One intra-op thread per small-model stage"): on another count its sampled
    tokens can differ in the last bits of the logits and so in the picture, whatever the engine does. On
    the same count both sides run the same kernels, so the comparison holds on any CPU."""
    threads = {runner.intra_op_threads for runner in glm_engine.runners.values()}
    assert threads == {1}  # both stages on one thread: the one-shot call (AR + DiT on one thread) matches
    engine_png = png(glm_engine.run(t2i(height=height, width=width, seed=seed)).images[0])
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's setting only
    try:
        one_shot = one_shot_pipeline(
            "a red 'cat'",
            height=height,
            width=width,
            num_inference_steps=4,
            guidance_scale=1.5,
            generator=torch.Generator().manual_seed(seed),
        ).images[0]
    finally:
        torch.set_num_threads(before)
    assert engine_png == png(one_shot)


def test_image_to_image_from_a_generated_png(glm_engine):
    source = glm_engine.run(t2i(height=64, width=64)).images[0]
    request = GenerationRequest("make it blue", GenerationParams(seed=3), image=source)
    first = glm_engine.run(request)
    again = glm_engine.run(request)
    assert first.images[0].size == source.size  # I2I defaults to the source's size
    assert png(first.images[0]) == png(again.images[0])
    other = glm_engine.run(
        GenerationRequest("make it blue", GenerationParams(seed=3), image=source.rotate(90))
    )
    assert png(other.images[0]) != png(first.images[0])  # the source image really conditions the result


def test_i2i_source_of_odd_size_is_fitted_to_the_ar_grid(glm_engine):
    from PIL import Image

    odd = Image.new("RGB", (70, 100), (200, 30, 30))
    result = glm_engine.run(GenerationRequest("x", GenerationParams(seed=1), image=odd))
    assert result.images[0].size == (64, 96)


def test_events_arrive_in_order_with_progress_and_previews(glm_engine):
    events = collect(glm_engine, t2i(height=64, width=64, preview_every=1))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "StageStarted" and kinds[-1] == "RunFinished"
    started = [e for e in events if isinstance(e, StageStarted)]
    assert [(e.stage_id, e.kind) for e in started] == [(0, "ar"), (1, "diffusion")]
    assert started[0].total == 16 * 16 + 2 * 2 + 1
    tokens = [e for e in events if isinstance(e, TokenProgress)]
    assert tokens and tokens[-1].step == tokens[-1].total == started[0].total
    steps = [e for e in events if isinstance(e, DiffusionStep)]
    assert [e.step for e in steps] == [1, 2, 3, 4]
    assert all(e.preview is not None and e.preview.size == (64, 64) for e in steps[:-1])
    finished = [e for e in events if isinstance(e, StageFinished)]
    assert [(e.stage_id, e.status) for e in finished] == [(0, "succeeded"), (1, "succeeded")]
    assert finished[0].output_tokens == started[0].total and finished[0].seconds > 0
    # stage 1 starts only after stage 0 finished
    assert kinds.index("StageFinished") < [i for i, k in enumerate(kinds) if k == "StageStarted"][1]


def test_n_outputs_use_consecutive_seeds(glm_engine):
    result = glm_engine.run(t2i(height=64, width=64, seed=10, n=2))
    assert [o.seed for o in result.outputs] == [10, 11]
    single = glm_engine.run(t2i(height=64, width=64, seed=11))
    assert png(result.outputs[1].images[0]) == png(single.images[0])


@pytest.mark.parametrize(
    "params, field",
    [
        ({"height": 48, "width": 64}, "height"),
        ({"height": 64, "width": 100}, "width"),
        ({"height": 64, "width": 64, "num_inference_steps": 0}, "num_inference_steps"),
        ({"height": 64, "width": 64, "n": 9}, "n"),
    ],
)
def test_bad_requests_name_the_field(glm_engine, params, field):
    with pytest.raises(RequestError) as info:
        glm_engine.resolve(t2i(**params))
    assert info.value.field == field
    assert "multiple of 32" in info.value.message or "must be" in info.value.message


def test_unsupported_modalities_and_inputs_are_refused(glm_engine, diffusion_engine):
    from engine.modality import OutputModality

    with pytest.raises(RequestError, match="produces image; cannot produce text") as info:
        glm_engine.resolve(GenerationRequest("x", modalities=(OutputModality.TEXT,)))
    assert info.value.field == "modalities"
    from PIL import Image

    with pytest.raises(RequestError, match="does not take a source image"):
        diffusion_engine.resolve(GenerationRequest("x", image=Image.new("RGB", (64, 64))))


def test_cancel_mid_run_frees_the_engine(glm_engine):
    request = t2i(height=256, width=256, num_inference_steps=200, preview_every=0)
    events: list = []
    got_step = threading.Event()
    done = threading.Event()

    def sink(event):
        events.append(event)
        if isinstance(event, DiffusionStep):
            got_step.set()
        if isinstance(event, (RunFinished, RunFailed)):
            done.set()

    handle = glm_engine.submit(glm_engine.resolve(request), sink)
    assert got_step.wait(60)
    handle.cancel()
    assert done.wait(30)
    terminal = events[-1]
    assert isinstance(terminal, RunFailed) and terminal.cancelled and terminal.error_type == "cancelled"
    steps = [e for e in events if isinstance(e, DiffusionStep)]
    assert steps[-1].step < 200  # stopped early
    assert glm_engine.in_flight == 0
    assert glm_engine.run(t2i(height=64, width=64)).images  # still serving


def test_closing_the_async_iterator_cancels_the_request(glm_engine):
    import asyncio

    async def main():
        resolved = glm_engine.resolve(t2i(height=256, width=256, num_inference_steps=200))
        agen = glm_engine.generate(resolved)
        async for event in agen:
            if isinstance(event, DiffusionStep):
                break
        await agen.aclose()
        for _ in range(300):
            if glm_engine.in_flight == 0:
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(main())


@pytest.mark.parametrize(
    ("method", "error", "message"),
    [
        ("run", RuntimeError("VAE exploded"), "stage 1 (diffusion) failed: RuntimeError: VAE exploded"),
        # The stage worker computes batch keys while it forms a batch: it used to die there, leaving every
        # queued request waiting.
        ("batch_key", ValueError("no batch key for this one"), "no batch key for this one"),
    ],
)
def test_a_failing_stage_gives_a_clear_error_and_the_engine_stays_usable(
    glm_engine, monkeypatch, method, error, message
):
    def broken(*args):
        raise error

    with monkeypatch.context() as patch:
        patch.setattr(glm_engine.runners[1], method, broken)
        events = collect(glm_engine, t2i(height=64, width=64))
    failed = events[-1]
    assert isinstance(failed, RunFailed) and not failed.cancelled
    assert failed.stage_id == 1 and message in failed.message
    assert [e.status for e in events if isinstance(e, StageFinished)] == ["succeeded", "failed"]
    assert glm_engine.run(t2i(height=64, width=64)).images  # the same stage serves the next request


def test_concurrent_requests_all_complete_and_match_sequential_results(glm_engine):
    requests = [t2i(height=64, width=64, seed=s) for s in range(4)]
    expected = [png(glm_engine.run(r).images[0]) for r in requests]
    results: dict[int, bytes] = {}
    done = threading.Event()

    def sink_for(i):
        def sink(event):
            if isinstance(event, RunFinished):
                results[i] = png(event.images[0])
                if len(results) == len(requests):
                    done.set()

        return sink

    for i, r in enumerate(requests):
        glm_engine.submit(glm_engine.resolve(r), sink_for(i))
    assert done.wait(120)
    assert [results[i] for i in range(4)] == expected


def test_diffusion_stage_batches_compatible_requests(session_data_dir):
    from tests.conftest import tiny_deploy

    source = materialize(describe_model("tiny-diffusion"), model_cache_dir(session_data_dir))
    config = build_pipeline_config(source, tiny_deploy("tiny-diffusion", stage0={"max_num_seqs": 4}))
    engine = OmniEngine.start(config, source)
    try:
        batch_sizes: list[int] = []
        done = threading.Semaphore(0)

        def sink(event):
            if isinstance(event, StageFinished):
                batch_sizes.append(event.batch_size)
            if isinstance(event, (RunFinished, RunFailed)):
                done.release()

        runner = engine.runners[0]
        gate = threading.Event()
        original = runner.run

        def gated(jobs):
            gate.wait(10)
            return original(jobs)

        runner.run = gated  # hold the first batch so the others queue up behind it
        for seed in range(4):
            engine.submit(engine.resolve(GenerationRequest("a cat", GenerationParams(seed=seed))), sink)
        time.sleep(0.2)
        gate.set()
        for _ in range(4):
            assert done.acquire(timeout=60)
        assert len(batch_sizes) == 4 and max(batch_sizes) > 1
        assert all(batch_sizes.count(size) % size == 0 for size in set(batch_sizes))  # k jobs report size k
    finally:
        engine.close()


def test_chat_streams_text_deltas(chat_engine):
    events = collect(chat_engine, GenerationRequest("hello there", GenerationParams(seed=5, max_tokens=12)))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert len(deltas) > 1 and "".join(deltas) == finished.text
    assert finished.outputs[0].output_tokens <= 12


def test_diffusion_only_family_makes_images(diffusion_engine):
    result = diffusion_engine.run(GenerationRequest("a cat", GenerationParams(seed=1, width=96)))
    assert result.images[0].size == (96, 64)


def test_invalid_output_name_fails_at_build_and_stops_started_stages(session_data_dir, monkeypatch):
    """A config built in code (bypassing validation) with a bad name fails before any request."""
    from dataclasses import replace

    from engine.pipelines.glm_image import GlmImageFamily

    source = materialize(describe_model("tiny-glm-image"), model_cache_dir(session_data_dir))
    config = build_pipeline_config(source)
    bad = replace(config, stages=(config.stages[0], replace(config.stages[1], engine_output_type="images")))
    closed: list[int] = []
    original = GlmImageFamily.create_runner

    def tracking(self, stage, path, device):
        runner = original(self, stage, path, device)
        runner_close = runner.close
        runner.close = lambda: (closed.append(stage.stage_id), runner_close())
        return runner

    monkeypatch.setattr(GlmImageFamily, "create_runner", tracking)
    with pytest.raises(EngineBuildError, match="stage 1 .*unknown output modality 'images'"):
        OmniEngine.start(bad, source)
    assert closed == [0]  # stage 0 had started and was shut down


def test_start_failure_of_a_later_stage_shuts_down_earlier_ones(session_data_dir, monkeypatch):
    from engine.pipelines.glm_image import GlmImageDiffusionStage

    source = materialize(describe_model("tiny-glm-image"), model_cache_dir(session_data_dir))
    config = build_pipeline_config(source)

    def fail(self):
        raise OSError("transformer weights are corrupt")

    monkeypatch.setattr(GlmImageDiffusionStage, "load", fail)
    with pytest.raises(
        EngineBuildError, match="stage 1 \\(diffusion\\) failed to start: transformer weights"
    ):
        OmniEngine.start(config, source)


def test_engine_busy_when_the_queue_is_full(session_data_dir):
    from engine.engine import EngineBusy

    source = materialize(describe_model("tiny-glm-image"), model_cache_dir(session_data_dir))
    engine = OmniEngine.start(build_pipeline_config(source), source, max_pending=1)
    try:
        resolved = engine.resolve(t2i(height=256, width=256, num_inference_steps=100))
        handle = engine.submit(resolved, lambda e: None)
        with pytest.raises(EngineBusy, match="limit 1"):
            engine.submit(engine.resolve(t2i()), lambda e: None)
        handle.cancel()
    finally:
        engine.close()


def test_templates_are_frozen():
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        StageTemplate(0, "ar", (), "text", True).kind = "diffusion"  # type: ignore[misc]


def test_a_request_id_already_in_flight_is_refused_and_the_first_run_is_untouched(glm_engine):
    """Events, cancel and the fair queues are per request id: a second submit of an id in flight is a
    RequestError naming ``request_id``, and the first request still finishes with its picture."""
    resolved = glm_engine.resolve(t2i(height=64, width=64))
    done = threading.Event()
    events = []

    def sink(event):
        events.append(event)
        if isinstance(event, RunFinished) or getattr(event, "message", None) is not None:
            done.set()

    glm_engine.submit(resolved, sink)
    with pytest.raises(RequestError) as caught:
        glm_engine.submit(resolved, sink)
    assert caught.value.field == "request_id" and "already in flight" in str(caught.value)
    assert done.wait(120)
    assert isinstance(events[-1], RunFinished) and events[-1].images[0].size == (64, 64)
