"""The trained built-in `tiny-glm-shapes`: it draws what the caption asks, through the whole AR -> DiT path.

This is the regression check of the hand-off: a transposed grid, a preview/target split off by one or
scrambled prior ids move or garble the shape, and the pixel classifier notices.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from engine.models import describe_model
from engine.tiny import BUILTIN_MODELS, ensure_builtin_model
from tests.conftest import png
from tools.shapes.classify import classify
from tools.shapes.world import parse_caption, quantise, render

# Fixed prompts and seeds: three held-out combinations (never trained on) and two training ones, covering
# every shape, every colour and four positions.
PROMPTS = [
    ("a red circle on a blue background, top left", 11),
    ("a yellow triangle on a purple background, top right", 12),
    ("a cyan square on a red background, center", 13),
    ("a green circle on a yellow background, top right", 14),
    ("a purple triangle on a cyan background, bottom left", 15),
]


@pytest.fixture(scope="module")
def shapes_engine(tmp_path_factory):
    from engine import build_engine

    engine = build_engine("tiny-glm-shapes", data_dir=tmp_path_factory.mktemp("shapes"))
    yield engine
    engine.close()


def generate(engine, prompt: str, seed: int):
    from engine import GenerationParams, GenerationRequest

    return engine.run(GenerationRequest(prompt, GenerationParams(seed=seed))).images[0]


def test_shipped_model_is_registered_small_and_in_the_real_layout(model_cache):
    model = BUILTIN_MODELS["tiny-glm-shapes"]
    assert model.shipped and describe_model("tiny-glm-shapes").family.name == "glm-image"
    path = ensure_builtin_model("tiny-glm-shapes", model_cache)
    assert path == model.shipped_path  # used in place, nothing built
    for component in (
        "vision_language_encoder",
        "processor",
        "transformer",
        "vae",
        "text_encoder",
        "tokenizer",
        "scheduler",
    ):
        assert (path / component).is_dir(), component
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 10_000_000, f"{size / 1e6:.2f} MB"


def test_prompt_set_mixes_held_out_and_training_combinations():
    scenes = [parse_caption(p) for p, _ in PROMPTS]
    assert all(scenes)
    assert sum(s.held_out for s in scenes) == 3
    # The classifier reads the world's own pictures right (so a failure below is the model's).
    assert all(all(classify(render(s)).correct(s).values()) for s in scenes)


def test_draws_what_the_caption_asks(shapes_engine):
    results = []
    for prompt, seed in PROMPTS:
        image = generate(shapes_engine, prompt, seed)
        assert image.size == (128, 128)
        reading = classify(np.asarray(image.convert("RGB")))
        results.append((prompt, reading, all(reading.correct(parse_caption(prompt)).values())))
    wrong = [(p, r) for p, r, ok in results if not ok]
    assert len(wrong) <= 1, f"wrong pictures: {wrong}"


def test_same_seed_same_bytes(shapes_engine):
    prompt, seed = PROMPTS[0]
    assert png(generate(shapes_engine, prompt, seed)) == png(generate(shapes_engine, prompt, seed))


def test_target_grid_reaches_the_dit_in_order(shapes_engine):
    """The AR stage's target grid, read back from the picture, is the caption's (row-major, not transposed)."""
    prompt, seed = PROMPTS[1]  # top right: a transposed grid would draw it bottom left
    image = np.asarray(generate(shapes_engine, prompt, seed).convert("RGB"))
    expected = quantise(render(parse_caption(prompt))).target
    assert (quantise(image).target == expected).mean() >= 0.75


def test_cli_run_draws_the_prompt(tmp_path, model_cache):
    """The acceptance command: `omni-studio run PROMPT --model tiny-glm-shapes --height 128 --width 128`."""
    from studio.cli import main

    prompt, seed = PROMPTS[2]
    out = tmp_path / "shape.png"
    assert (
        main(
            [
                "run",
                prompt,
                "--model",
                "tiny-glm-shapes",
                "--height",
                "128",
                "--width",
                "128",
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--data-dir",
                str(tmp_path / "data"),
                "--quiet",
            ]
        )
        == 0
    )
    reading = classify(np.asarray(Image.open(out).convert("RGB")))
    assert all(reading.correct(parse_caption(prompt)).values()), reading


def test_a_partial_deploy_config_takes_the_models_own_defaults(tmp_path):
    """A deploy config that names the stages and nothing else: a request with no size draws at the model's
    own 128x128 with its 8 steps and greedy tokens (its card, then its preset), and draws the caption;
    the family's 1024x1024 / 50 steps never reach a model that cannot draw them."""
    from engine import build_engine

    partial = tmp_path / "partial.yaml"
    partial.write_text("stages: [{stage_id: 0}, {stage_id: 1}]\n")
    engine = build_engine("tiny-glm-shapes", partial, data_dir=tmp_path / "data")
    try:
        stages = {s.stage_id: s.default_sampling_params for s in engine.config.stages}
        assert stages[1]["height"] == stages[1]["width"] == 128 and stages[1]["num_inference_steps"] == 8
        assert stages[0]["temperature"] == 0.0
        prompt, seed = PROMPTS[0]
        image = generate(engine, prompt, seed)
        assert image.size == (128, 128)
        assert all(classify(np.asarray(image.convert("RGB"))).correct(parse_caption(prompt)).values())
    finally:
        engine.close()


def test_a_size_the_model_never_saw_still_gets_a_whole_grid(shapes_engine):
    """Asked for 256x256, the trained AR ends its grid early (it learned 128x128 grids); its end token is
    held back until the grid is full, so the run draws a 256x256 picture instead of failing in the engine."""
    from engine import GenerationParams, GenerationRequest

    result = shapes_engine.run(
        GenerationRequest(PROMPTS[0][0], GenerationParams(seed=3, height=256, width=256))
    )
    assert result.images[0].size == (256, 256)
