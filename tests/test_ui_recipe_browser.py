"""The recipe drop in a real browser: a PNG the studio made, dropped on the Chat tab's "Load recipe from
PNG", puts its prompt and parameters back in the form; a PNG without a recipe says so (docs/recipes.md)."""

from __future__ import annotations

import base64
import uuid

import httpx
import pytest
from PIL import Image

from tests.servers import running_server

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--ar-backend", "transformers"], tmp_path_factory.mktemp("recipe-ui")
    ) as server:
        yield server


def number(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} input[type=number]").first.input_value()


def drop(page, path) -> None:
    page.set_input_files("#omni-recipe input[type=file]", str(path))


def test_dropping_a_recipe_png_restores_the_chat_form(page, studio, tmp_path):
    prompt = f"a recipe drop {uuid.uuid4().hex[:6]}"
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "seed": 4242,
        "size": "96x64",
        "num_inference_steps": 6,
        "guidance_scale": 2.5,
        "negative_prompt": "blurry, dark",
    }
    response = httpx.post(studio.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    made = tmp_path / "made-here.png"
    made.write_bytes(base64.b64decode(url.split(",", 1)[1]))
    assert page.input_value("#omni-message textarea") == ""  # a fresh form: nothing to restore by chance

    drop(page, made)
    page.wait_for_function("document.querySelector('#omni-recipe-note').innerText.includes('Restored')")
    assert page.input_value("#omni-message textarea") == prompt
    assert number(page, "omni-seed") == "4242"
    assert (number(page, "omni-width"), number(page, "omni-height")) == ("96", "64")
    assert (number(page, "omni-steps"), number(page, "omni-guidance")) == ("6", "2.5")
    assert page.get_by_label("Negative prompt").input_value() == "blurry, dark"
    note = page.inner_text("#omni-recipe-note")
    assert "Restored from an Omni Studio recipe" in note and "the running model and config" in note
    page.screenshot(path=str(tmp_path / "recipe-drop.png"))  # scripts/screenshots.py makes the docs' one

    # Sending the restored form reproduces the picture, byte for byte.
    page.keyboard.press("Escape")
    page.locator("#omni-message textarea").press("Enter")
    page.wait_for_function("document.querySelector('#omni-chat-status').innerText.includes('Done in')")
    shown = page.locator("#omni-chatbot img").last.get_attribute("src")
    assert shown is not None
    again = httpx.get(shown if shown.startswith("http") else studio.url + shown, timeout=30).content
    assert again == made.read_bytes()

    plain = tmp_path / "no-recipe.png"
    Image.new("RGB", (16, 16), (1, 2, 3)).save(plain)
    drop(page, plain)
    page.wait_for_function(
        "document.querySelector('#omni-recipe-note').innerText.includes('carries no recipe')"
    )
    assert "no-recipe.png carries no recipe" in page.inner_text("#omni-recipe-note")
    assert number(page, "omni-seed") == "4242"  # the form is left as it was
