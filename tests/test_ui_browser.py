"""The studio in a real browser: headless Debian Chromium driven by Playwright against `omni-studio ui`
on 127.0.0.1 with the tiny pipeline."""

from __future__ import annotations

import base64
import io
import re
import uuid

import httpx
import pytest
from PIL import Image

from tests.browser import open_tab, send_prompt, set_number
from tests.servers import running_server

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(["ui", "--ar-backend", "transformers"], tmp_path_factory.mktemp("studio")) as server:
        yield server


def watch_chat(page) -> None:
    """Record, in the page, the order in which a preview and the final image first appear."""
    page.evaluate("""() => {
        window.__omni = [];
        const seen = (name) => { if (!window.__omni.includes(name)) window.__omni.push(name); };
        new MutationObserver(() => {
            if (document.querySelector('#omni-preview img')) seen('preview');
            if (document.querySelector('#omni-chatbot img')) seen('image');
        }).observe(document.body, {subtree: true, childList: true, attributes: true});
    }""")


def test_chat_shows_previews_then_the_image(page):
    set_number(page, "omni-steps", "8")
    watch_chat(page)
    send_prompt(page, "a red 'cat' on a blue background")
    page.wait_for_selector("#omni-chatbot img")
    assert page.evaluate("window.__omni") == ["preview", "image"]
    page.wait_for_selector("#omni-progress [data-stage='1'][data-status='succeeded']")
    assert "8/8 steps" in page.inner_text("#omni-progress")
    assert "Done in" in page.inner_text("#omni-chat-status")


def test_invalid_modality_is_reported_then_a_valid_change_is_used(page):
    open_tab(page, "Pipeline")
    dropdown = page.locator("#omni-stage1-output input")
    dropdown.fill("images")
    dropdown.press("Enter")
    page.click("#omni-form-to-yaml")
    page.wait_for_function("document.querySelector('#omni-deploy-yaml').innerText.includes('images')")
    page.click("#omni-validate")
    page.wait_for_selector("#omni-stage1-errors .omni-errors")
    errors = page.inner_text("#omni-stage1-errors")
    assert "engine_output_type" in errors and "unknown output modality 'images'" in errors
    assert "valid names are text, image, audio, latent, token_ids" in errors
    # a valid change: the diffusion stage's default step count
    dropdown.fill("image")
    dropdown.press("Enter")
    steps_box = page.get_by_label(re.compile(r"^num_inference_steps")).first
    steps_box.fill("6")
    page.click("#omni-form-to-yaml")
    page.wait_for_function(
        "document.querySelector('#omni-deploy-yaml').innerText.includes('num_inference_steps: 6')"
    )
    page.click("#omni-apply")
    page.wait_for_selector("#omni-pipeline-result .omni-ok")
    assert "Applied" in page.inner_text("#omni-pipeline-result")
    open_tab(page, "Chat")
    page.wait_for_function("document.querySelector('#omni-steps input[type=number]').value === '6'")
    send_prompt(page, "after apply")
    page.wait_for_selector("#omni-progress [data-stage='1'][data-status='succeeded']")
    assert "6/6 steps" in page.inner_text("#omni-progress")


def test_fingerprint_change_reaches_the_api(page, studio):
    open_tab(page, "Serving")
    page.locator("#omni-fp-mode").get_by_text("custom", exact=True).click()
    page.fill("#omni-fp-value textarea, #omni-fp-value input", "browser-fp-1")
    page.click("#omni-fp-apply")
    page.wait_for_function("document.querySelector('#omni-current-fingerprint').innerText === 'browser-fp-1'")
    body = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "fp"}], "seed": 2},
    ).json()
    assert body["system_fingerprint"] == "browser-fp-1"
    page.locator("#omni-fp-mode").get_by_text("none", exact=True).click()
    page.click("#omni-fp-apply")
    page.wait_for_function("document.querySelector('#omni-current-fingerprint').innerText === 'none'")
    body = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "fp"}], "seed": 2},
    ).json()
    assert "system_fingerprint" not in body


def api_run(studio, prompt: str, seed: int) -> bytes:
    response = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": prompt}], "seed": seed},
    )
    assert response.status_code == 200
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def test_api_run_appears_in_history_and_rerun_reproduces_its_bytes(page, studio):
    prompt = f"history check {uuid.uuid4().hex[:8]}"
    original = api_run(studio, prompt, seed=77)
    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", prompt)
    page.click("#omni-h-find")
    page.wait_for_function(f"document.querySelector('#omni-h-table').innerText.includes({prompt!r})")
    row = page.locator("#omni-h-table").get_by_text(prompt).filter(visible=True).first
    row.click()
    page.wait_for_function(f"document.querySelector('#omni-h-detail').innerText.includes({prompt!r})")
    detail = page.inner_text("#omni-h-detail")
    assert "api" in detail and "succeeded" in detail and "Seed 77" in detail
    page.click("#omni-h-rerun")
    page.wait_for_function("document.querySelector('#omni-h-rerun-result').innerText.includes('finished')")
    assert "identical bytes" in page.inner_text("#omni-h-rerun-result")
    # The picture the page shows as the re-run's output, decoded, is the API's original pixel for pixel.
    shown = page.locator(".block").filter(has=page.get_by_text("Re-run output", exact=True)).locator("img")
    shown.wait_for()
    src = shown.get_attribute("src")
    assert src is not None
    rerun = httpx.get(src if src.startswith("http") else studio.url + src, timeout=30)
    assert rerun.status_code == 200
    first, again = (Image.open(io.BytesIO(data)) for data in (original, rerun.content))
    assert (again.mode, again.size) == (first.mode, first.size)
    assert again.tobytes() == first.tobytes()


def test_compare_shows_the_parameter_diff(page, studio):
    tag = uuid.uuid4().hex[:8]
    ids = []
    for seed in (5, 6):
        response = httpx.post(
            studio.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": f"compare {tag}"}], "seed": seed},
        )
        ids.append(response.headers["x-run-id"])
    open_tab(page, "History")
    page.fill("#omni-h-run-a textarea, #omni-h-run-a input", ids[0])
    page.fill("#omni-h-run-b textarea, #omni-h-run-b input", ids[1])
    page.click("#omni-h-compare")
    page.wait_for_function("document.querySelector('#omni-h-diff').innerText.includes('seed')")
    # The whole table as shown: its header, then one row (part, key, A, B): only the seed differs, 5 vs 6.
    assert page.inner_text("#omni-h-diff").split() == [
        "part",
        "key",
        "A",
        "B",
        "parameters",
        "seed",
        "5",
        "6",
    ]


def test_history_loads_more_runs_after_the_first_page(page, studio):
    from studio.store import open_store

    tag = f"many {uuid.uuid4().hex[:8]}"
    with open_store(None, studio.data_dir) as store:  # the studio's own SQLite file, shared (WAL)
        for i in range(57):
            run_id = store.create_run(
                source="api", prompt=f"{tag} #{i}", model="tiny-glm-image", request={}, parameters={}
            )
            store.finish_run(run_id, "succeeded")
    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", tag)
    page.click("#omni-h-find")
    page.wait_for_function(
        "document.querySelector('#omni-h-count').innerText.includes('57 run(s) match; showing 50')"
    )
    page.click("#omni-h-more")
    page.wait_for_function("document.querySelector('#omni-h-count').innerText.includes('showing 57')")
    assert not page.locator("#omni-h-more").is_visible()  # that was the last page
