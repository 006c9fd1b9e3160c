"""Batch invariance: a request gives the same ids and PNG bytes alone and inside a batch of 8 different
concurrent requests (docs/batching.md). In-process engines; a blocker request holds the stage while the 8
are submitted from threads, so they form one batch (StageFinished.batch_size says so)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine import GenerationParams, GenerationRequest
from engine.engine import OmniEngine, build_engine
from engine.events import RunFinished, StageFinished
from engine.paths import DEPLOY_PRESETS_DIR
from engine.stages.row_plan import REFUSE_ENV

PROMPTS = [
    "a red circle on a blue background, top left",
    "a green square on a yellow background, center",
    "a purple triangle on a cyan background, bottom right",
    "a blue circle on a red background, top right",
    "a yellow square on a purple background, bottom left",
    "a cyan triangle on a green background, center",
    "a red square on a cyan background, top left",
    "a green circle on a purple background, bottom right",
]


@pytest.fixture(scope="module", autouse=True)
def env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("OMNI_STUDIO_MODEL_CACHE") or os.environ.get("OMNI_STUDIO_TEST_MODEL_CACHE")
    path = Path(cache) if cache else tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_STUDIO_MODEL_CACHE", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield tmp_path_factory.mktemp("data")


def deploy(model: str, ar_seqs: int = 8, dit_seqs: int = 8, own_process: bool = False) -> dict[str, Any]:
    """The preset with these batch sizes; both stages in this process unless ``own_process`` (the tests
    look inside the runners)."""
    config = yaml.safe_load((DEPLOY_PRESETS_DIR / f"{model}.yaml").read_text())
    config["stages"][0].update(max_num_seqs=ar_seqs, final_output=True, final_output_type="token_ids")
    config["stages"][1].update(max_num_seqs=dit_seqs, own_process=own_process)
    return config


def png(result: RunFinished) -> str:
    buffer = io.BytesIO()
    result.images[0].save(buffer, format="PNG")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def request(prompt: str, seed: int, params: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(prompt, GenerationParams(seed=seed, **params))


def run_batch(
    engine: OmniEngine, requests: list[GenerationRequest]
) -> tuple[list[RunFinished], dict[int, list[int]], list[int]]:
    """Run ``requests`` concurrently behind a blocker; returns results, each stage's batch sizes and, per
    request, the most rows a decode step of its stage 0 computed together."""
    results: list[Any] = [None] * len(requests)
    sizes: dict[int, list[int]] = {}
    step_rows = [0] * len(requests)
    lock = threading.Lock()

    def one(i: int, req: GenerationRequest) -> None:
        for event in engine.stream(engine.resolve(req)):
            if isinstance(event, StageFinished):
                with lock:
                    sizes.setdefault(event.stage_id, []).append(event.batch_size)
                    if event.stage_id == 0 and i >= 0:
                        step_rows[i] = event.step_rows
            if isinstance(event, RunFinished) and i >= 0:
                results[i] = event

    first = requests[0]
    blockers = [
        # Holds stage 0 while the 8 are submitted, so they decode together. Each blocker is a request of
        # its own (its own id, so its own client in the engine's fair queues).
        threading.Thread(
            target=one,
            args=(
                -1,
                GenerationRequest(first.prompt, replace(first.params, seed=999, height=512, width=512)),
            ),
        ),
        # Reaches stage 1 first and holds it (many steps) while the 8 finish decoding and queue there.
        threading.Thread(
            target=one,
            args=(
                -1,
                GenerationRequest(first.prompt, replace(first.params, seed=998, num_inference_steps=1000)),
            ),
        ),
    ]
    for blocker in blockers:
        blocker.start()
    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in [*blockers, *threads]:
        thread.join(timeout=300)
    assert all(r is not None for r in results)
    return results, sizes, step_rows


def check(
    engine: OmniEngine, params: dict[str, Any], expect_dit_batch: int = 1, shared_steps: bool = False
) -> None:
    """Alone vs 8 concurrent: same ids and PNG bytes; stage 0 held all 8 at once (with ``shared_steps``:
    and its decode steps computed all 8 rows together) and stage 1 ran batches of at least
    ``expect_dit_batch``."""
    requests = [request(p, 7 + i, params) for i, p in enumerate(PROMPTS)]
    alone = [engine.run(r) for r in requests]
    batched, sizes, step_rows = run_batch(engine, requests)
    assert max(sizes[0]) >= 8
    if shared_steps:
        # Stage 0 holds 8 jobs at once (the blocker and 7 of the 8; the last joins when one leaves):
        # decode steps computed 8 rows together, and every request shared its steps.
        assert max(step_rows) >= 8 and min(step_rows) >= 2, step_rows
    assert max(sizes[1]) >= expect_dit_batch
    for a, b in zip(alone, batched, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert png(a) == png(b)


@pytest.mark.parametrize(
    ("model", "params"),
    [
        ("tiny-glm-shapes", {}),  # greedy (the preset)
        ("tiny-glm-image", {"temperature": 1.0}),  # seeded sampling
    ],
)
def test_transformers_ar_batch_invariance(env: Path, model: str, params: dict[str, Any]) -> None:
    """On this machine's own kernels, whatever the decode path its checks chose (docs/batching.md)."""
    engine = build_engine(model, deploy(model), data_dir=env, ar_backend="transformers")
    try:
        check(engine, params, shared_steps=True)
        assert engine.decode_paths()[0].startswith("batched, tiles of")
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("refuse", "paths"),
    [
        # Tiles fail (as some CPUs' products do at every tile): whichever checked fallback holds here.
        ("tiled", ("in one call on the live rows", "as single-row products in one call", "one row per call")),
        # Products' kernels also change with the row count, as on a Xeon (docs/batching.md).
        ("tiled,live-rows", ("as single-row products in one call", "one row per call")),
        ("tiled,live-rows,single-row-batch", ("one row per call",)),  # the last resort
    ],
)
def test_transformers_ar_guarded_fallbacks_still_share_steps(
    env: Path, monkeypatch: pytest.MonkeyPatch, refuse: str, paths: tuple[str, ...]
) -> None:
    """Where the kernels fail the tile check (forced here, whatever this CPU does), the step still
    computes the 8 rows together, with the failing functions on a fallback: the same ids and bytes as
    alone, and the System tab's words say which path runs."""
    monkeypatch.setenv(REFUSE_ENV, refuse)
    engine = build_engine(
        "tiny-glm-shapes", deploy("tiny-glm-shapes"), data_dir=env, ar_backend="transformers"
    )
    try:
        check(engine, {}, shared_steps=True)
        described = engine.decode_paths()[0]
        assert "guarded fallback" in described and any(path in described for path in paths), described
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("model", "params"),
    [("tiny-glm-shapes", {}), ("tiny-glm-image", {"temperature": 1.0, "guidance_scale": 2.0})],
)
def test_diffusion_stage_batch_invariance(env: Path, model: str, params: dict[str, Any]) -> None:
    """The presets batch the DiT (stage 1 max_num_seqs 4 or 8, per-sample linears and VAE decode):
    requests that share a DiT batch still give their alone bytes, with and without classifier-free
    guidance."""
    preset = yaml.safe_load((DEPLOY_PRESETS_DIR / f"{model}.yaml").read_text())
    assert preset["stages"][1]["max_num_seqs"] >= 4
    engine = build_engine(model, deploy(model, 8, 8), data_dir=env)
    try:
        check(engine, params, expect_dit_batch=3)
        checks = engine.runners[1].batch_checks
        assert checks and all(checks.values())  # the batches really ran batched
    finally:
        engine.close()


def test_diffusion_stage_in_its_own_process_batches_invariantly(env: Path) -> None:
    """tiny-glm-shapes' preset runs its DiT in a process of its own (docs/batching.md): batches there
    still give every request its alone bytes."""
    preset = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-shapes.yaml").read_text())
    assert preset["stages"][1]["own_process"] is True
    engine = build_engine("tiny-glm-shapes", deploy("tiny-glm-shapes", 8, 4, own_process=True), data_dir=env)
    try:
        assert engine.runners[1].placement()[0]["pid"] != os.getpid()  # type: ignore[attr-defined]
        check(engine, {}, expect_dit_batch=3)
    finally:
        engine.close()


class _NoBatch:
    """A batch size the stage cannot set: its per-sample modules never split (the plain batched DiT)."""

    @property
    def size(self) -> int:
        return 1

    @size.setter
    def size(self, value: int) -> None:
        pass


def test_diffusion_stage_checks_before_batching(env: Path) -> None:
    """Without per-sample linears tiny-glm-image's DiT batches differ from alone in the last bits; the
    stage's one-time check per batch key sees it and runs such batches one by one: still the alone bytes."""
    engine = build_engine("tiny-glm-image", deploy("tiny-glm-image"), data_dir=env)
    try:
        runner = engine.runners[1]
        runner._batch = _NoBatch()
        check(engine, {"temperature": 1.0, "guidance_scale": 2.0}, expect_dit_batch=3)
        assert list(runner.batch_checks.values()) == [False]
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("model", "params"),
    [("tiny-glm-shapes", {}), ("tiny-glm-image", {"temperature": 1.0})],
)
def test_vllm_ar_batch_invariance(env: Path, model: str, params: dict[str, Any]) -> None:
    pytest.importorskip("vllm")
    engine = build_engine(model, deploy(model), data_dir=env, ar_backend="vllm")
    try:
        check(engine, params)
    finally:
        engine.close()
