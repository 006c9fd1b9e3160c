"""ar2diffusion: preview/target split, 2x nearest upsampling, I2I prior_image ids, parameters passed on."""

import pytest
import torch

from engine.processors import ar2diffusion, grid_layout, upsample_grid_ids


def test_grid_layout_matches_glm_image_processor():
    square = grid_layout(1024, 1024, text_to_image=True)
    assert (square.target_h, square.target_w, square.preview_h, square.preview_w) == (32, 32, 16, 16)
    assert square.max_new_tokens == 16 * 16 + 32 * 32 + 1
    tall = grid_layout(96, 64, text_to_image=True)
    assert (tall.target_h, tall.target_w) == (3, 2)
    assert (tall.preview_h, tall.preview_w) == (19, 13)  # int(sqrt(1.5)*16), int(sqrt(1/1.5)*16)
    assert grid_layout(64, 64, text_to_image=False).max_new_tokens == 2 * 2 + 1


def test_upsample_is_nearest_2x_row_major():
    ids = torch.tensor([1, 2, 3, 4, 5, 6])  # 2 rows x 3 cols
    up = upsample_grid_ids(ids, 2, 3).reshape(4, 6)
    assert up.tolist() == [
        [1, 1, 2, 2, 3, 3],
        [1, 1, 2, 2, 3, 3],
        [4, 4, 5, 5, 6, 6],
        [4, 4, 5, 5, 6, 6],
    ]
    with pytest.raises(ValueError, match="expected 2x3=6 ids, got 5"):
        upsample_grid_ids(ids[:5], 2, 3)


def test_t2i_takes_the_target_grid_after_the_preview():
    layout = grid_layout(96, 64, text_to_image=True)
    preview = torch.full((layout.preview_tokens,), 7)
    target = torch.arange(100, 100 + layout.target_tokens)  # 3x2
    generated = torch.cat([preview, target, torch.tensor([129])])  # + end token
    params = {
        "height": 96,
        "width": 64,
        "seed": 5,
        "num_inference_steps": 3,
        "guidance_scale": 2.5,
        "negative_prompt": "blurry",
        "prompt": "p",
    }
    out = ar2diffusion({"token_ids": generated}, params)
    assert out["prior_token_ids"].shape == (1, 4 * 3 * 2)
    assert out["prior_token_ids"].reshape(6, 4).tolist() == [
        [100, 100, 101, 101],
        [100, 100, 101, 101],
        [102, 102, 103, 103],
        [102, 102, 103, 103],
        [104, 104, 105, 105],
        [104, 104, 105, 105],
    ]
    assert 7 not in out["prior_token_ids"]  # nothing from the preview grid leaks in
    for key in (
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "negative_prompt",
        "height",
        "width",
        "prompt",
    ):
        assert out[key] == params[key]
    assert out["prior_token_image_ids"] is None and out["source_image_grid_thw"] is None


def test_i2i_has_no_preview_and_upsamples_the_source_ids():
    target = torch.arange(4)
    source = torch.tensor([10, 11, 12, 13, 14, 15])  # a 2x3 source grid
    out = ar2diffusion(
        {
            "token_ids": torch.cat([target, torch.tensor([129])]),
            "prior_image": source,
            "prior_image_grid_thw": torch.tensor([[1, 2, 3]]),
        },
        {"height": 64, "width": 64, "seed": 1, "num_inference_steps": 2, "guidance_scale": 1.5},
    )
    assert out["prior_token_ids"].reshape(4, 4)[0].tolist() == [0, 0, 1, 1]
    (prior_image,) = out["prior_token_image_ids"]
    assert prior_image.reshape(4, 6)[3].tolist() == [13, 13, 14, 14, 15, 15]
    (grid,) = out["source_image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]


def test_too_few_ids_is_a_clear_error():
    with pytest.raises(ValueError, match="produced 10 ids but ar2diffusion needs"):
        ar2diffusion({"token_ids": torch.arange(10)}, {"height": 64, "width": 64})
    with pytest.raises(ValueError, match="needs 'token_ids'"):
        ar2diffusion({"text": "hi"}, {"height": 64, "width": 64})
