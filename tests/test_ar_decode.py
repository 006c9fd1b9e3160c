"""The transformers runner's lean decode loop gives exactly ``generate``'s token ids (docs/batching.md).

Each case runs one request twice on the same engine: once through the lean loop (the default for
GLM-Image text-to-image) and once with the lean loop switched off (``generate`` after reseeding the global
RNG, the path GLM-Image's own pipeline takes), and compares the ids.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine import GenerationParams, GenerationRequest
from engine.engine import OmniEngine, build_engine
from engine.events import StageFinished, StageStatus, TokenProgress
from engine.paths import DEPLOY_PRESETS_DIR


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


def deploy(**sampling: Any) -> dict[str, Any]:
    """tiny-glm-image's preset with stage 0's ids in the result and extra default sampling parameters."""
    config = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-image.yaml").read_text())
    config["stages"][0].update(final_output=True, final_output_type="token_ids")
    config["stages"][0]["default_sampling_params"].update(sampling)
    return config


def ids(engine: OmniEngine, lean: bool, prompt: str = "a red 'cat'", **params: Any) -> list[int]:
    runner = engine.runners[0]
    if not lean:
        runner.fast_decoder = lambda: None  # type: ignore[method-assign]
    try:
        params.setdefault("seed", 7)
        result = engine.run(GenerationRequest(prompt, GenerationParams(**params)))
    finally:
        runner.__dict__.pop("fast_decoder", None)
    return list(result.outputs[0].token_ids)


@pytest.fixture(scope="module")
def plain(data_dir: Path) -> OmniEngine:
    engine = build_engine("tiny-glm-image", deploy(), data_dir=data_dir)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "seed": 3},
        {"temperature": 1.3, "top_k": 20},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 11},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_lean_loop_ids_equal_generate(plain: OmniEngine, params: dict[str, Any]) -> None:
    lean = ids(plain, True, **params)
    assert lean == ids(plain, False, **params)
    assert len(lean) > 1


@pytest.mark.parametrize(
    "sampling",
    [{"min_p": 0.05, "temperature": 1.0}, {"repetition_penalty": 1.3, "temperature": 1.0}, {"min_tokens": 5}],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_lean_loop_ids_equal_generate_with_stage_sampling(data_dir: Path, sampling: dict[str, Any]) -> None:
    engine = build_engine("tiny-glm-image", deploy(**sampling), data_dir=data_dir)
    try:
        assert ids(engine, True) == ids(engine, False)
    finally:
        engine.close()


def stage_ids(engine: OmniEngine, lean: bool, **params: Any) -> list[int]:
    """Stage 0's ids as its runner finishes (the hand-off to the DiT may refuse a short grid)."""
    runner = engine.runners[0]
    seen: list[list[int]] = []
    original = runner.finish

    def finish(job: Any, generated: Any, prepared: Any) -> dict[str, Any]:
        seen.append(generated.tolist())
        return original(job, generated, prepared)

    runner.finish = finish  # type: ignore[method-assign]
    try:
        with contextlib.suppress(RuntimeError):
            ids(engine, lean, **params)
    finally:
        del runner.finish
    return seen[0]


def test_early_stop_token(data_dir: Path, plain: OmniEngine) -> None:
    """A stop id the model emits early ends both loops at the same token (included, as generate does)."""
    greedy = ids(plain, True, temperature=0.0)
    stop = greedy[5]
    engine = build_engine("tiny-glm-image", deploy(stop_token_ids=[stop]), data_dir=data_dir)
    try:
        lean = stage_ids(engine, True, temperature=0.0)
        assert lean == stage_ids(engine, False, temperature=0.0)
        assert lean == greedy[: greedy.index(stop) + 1]
    finally:
        engine.close()


def test_cancel_stops_mid_decode(data_dir: Path) -> None:
    """Cancelling during the decode ends the job within a few tokens, long before max_tokens."""
    engine = build_engine("tiny-glm-image", deploy(), data_dir=data_dir)
    try:
        request = GenerationRequest("a long one", GenerationParams(seed=1, height=512, width=512))
        resolved = engine.resolve(request)
        events: list[Any] = []
        done = threading.Event()
        cancelled_at: list[float] = []

        def sink(event: Any) -> None:
            events.append(event)
            if isinstance(event, TokenProgress) and event.step >= 20 and not cancelled_at:
                cancelled_at.append(time.monotonic())
                threading.Thread(target=engine.cancel, args=(resolved.request_id,)).start()
            if isinstance(event, StageFinished) and event.stage_id == 0:
                done.set()

        engine.submit(resolved, sink)
        assert done.wait(120)
        finished = [e for e in events if isinstance(e, StageFinished) and e.stage_id == 0]
        assert finished and finished[0].status == StageStatus.CANCELLED
        steps = [e.step for e in events if isinstance(e, TokenProgress)]
        total = next(e.total for e in events if isinstance(e, TokenProgress))
        assert max(steps) < total / 2
        assert time.monotonic() - cancelled_at[0] < 5
    finally:
        engine.close()
