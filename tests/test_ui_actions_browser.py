"""The studio's actions in a real browser (headless Debian Chromium, Playwright) against `omni-studio ui` on
127.0.0.1: Send result to source image, Stop, Delete run, Load preset, and a text model in the Chat tab.

Each test checks what the user sees in the page and what the run store and the API then hold.
"""

from __future__ import annotations

import base64
import contextlib
import io
import re
import time
import uuid
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.browser import open_tab, send_prompt, set_number
from tests.servers import running_server

pytestmark = pytest.mark.browser

WAIT_S = 120  # bounds a hang only; every wait is on a state of the page or the store


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--ar-backend", "transformers"], tmp_path_factory.mktemp("studio-actions")
    ) as server:
        yield server


def wait_text(page, selector: str, text: str) -> None:
    page.wait_for_function(
        "([s, t]) => (document.querySelector(s)?.innerText || '').includes(t)",
        arg=[selector, text],
        timeout=WAIT_S * 1000,
    )


def finished_run_id(page, studio) -> str:
    """Wait for the Chat run to finish; its full id (the status line shows the first 12 characters)."""
    wait_text(page, "#omni-chat-status", "Done in")
    match = re.search(r"run ([0-9a-f]{12})", page.inner_text("#omni-chat-status"))
    assert match, page.inner_text("#omni-chat-status")
    return recorded(studio, lambda store: store.resolve_run_id(match.group(1))).id


def run_of_prompt(store: Any, prompt: str) -> str:
    """The id of the latest run of ``prompt`` (LookupError until it is recorded)."""
    for run in store.list_runs(limit=50):
        if run.prompt == prompt:
            return run.id
    raise LookupError(prompt)


def recorded(studio, find: Any, done: Any = lambda run: run.status not in ("queued", "running")) -> Any:
    """The run ``find(store)`` names, once the studio's recorder wrote it and ``done(run)`` holds."""
    from studio.store import open_store

    deadline = time.monotonic() + WAIT_S
    while True:
        # The studio's own SQLite file, shared (WAL).
        with open_store(None, studio.data_dir) as store, contextlib.suppress(LookupError):
            run = store.get_run(find(store))
            if done(run):
                return run
        assert time.monotonic() < deadline, "the run was never recorded as expected"
        time.sleep(0.2)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_send_result_to_source_makes_it_the_next_prompts_source_image(page, studio):
    tag = uuid.uuid4().hex[:8]
    send_prompt(page, f"a red circle {tag}")
    first = finished_run_id(page, studio)
    result_src = page.locator("#omni-chatbot img").last.get_attribute("src")
    assert result_src
    page.click("#omni-to-source")
    wait_text(page, "#omni-chat-status", "The last result is the source image of the next prompt")

    # The message box now carries the result as its attached image: the same pixels.
    thumbnail = page.locator("#omni-message img")
    thumbnail.wait_for()
    attached = httpx.get(thumbnail.get_attribute("src") or "", timeout=30)
    shown = httpx.get(result_src, timeout=30)
    assert attached.status_code == shown.status_code == 200
    assert np.array_equal(pixels(attached.content), pixels(shown.content))

    # Sending the next prompt runs image-to-image on exactly that picture.
    send_prompt(page, f"make it blue {tag}")
    second = finished_run_id(page, studio)
    assert second != first
    first_run = recorded(studio, lambda store: first)
    second_run = recorded(studio, lambda store: second)
    (output,) = [o for o in first_run.outputs if o.kind == "image"]
    (source,) = [o for o in second_run.outputs if o.kind == "source"]
    # The same picture (not the same file: the result's PNG also carries its run's recipe).
    assert np.array_equal(pixels(source.path.read_bytes()), pixels(output.path.read_bytes()))
    assert page.locator("#omni-message img").count() == 0  # the box is empty again after sending


def test_stop_ends_the_running_generation_as_cancelled(page, studio):
    tag = uuid.uuid4().hex[:8]
    set_number(page, "omni-steps", "100")
    for elem in ("omni-width", "omni-height"):
        set_number(page, elem, "512")
    send_prompt(page, f"a long run to stop {tag}")
    page.wait_for_selector("#omni-progress [data-stage='1'][data-status='running']")
    page.click("#omni-stop")
    wait_text(page, "#omni-chat-status", "Stopped")
    assert "Stopped" in page.inner_text("#omni-chatbot")
    assert page.locator("#omni-chatbot img").count() == 0  # no picture came out of it
    assert "100/100 steps" not in page.inner_text("#omni-progress")

    run = recorded(studio, lambda store: store.list_runs(_search(tag), limit=1)[0].id)
    assert run.status == "cancelled" and run.source == "ui", (run.status, run.source)
    assert run.error and "cancelled" in run.error
    assert not [o for o in run.outputs if o.kind == "image"]
    # The engine is free again: the next request runs.
    response = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={"messages": [{"role": "user", "content": f"after stop {tag}"}], "seed": 1},
    )
    assert response.status_code == 200, response.text


def _search(text: str) -> Any:
    from studio.store import RunFilter

    return RunFilter(search=text)


def test_delete_run_removes_it_from_the_runs_list_the_store_and_the_api(page, studio):
    tag = uuid.uuid4().hex[:8]
    prompt = f"to delete {tag}"
    response = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={"messages": [{"role": "user", "content": prompt}], "seed": int(tag, 16) % 100_000},
    )
    assert response.status_code == 200, response.text
    run_id = response.headers["x-run-id"]
    run = recorded(studio, lambda store: run_id)
    (output,) = [o for o in run.outputs if o.kind == "image"]
    output_url = f"{studio.url}/v1/outputs/{output.sha256}.png"
    assert httpx.get(output_url, timeout=30).status_code == 200

    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", prompt)
    page.click("#omni-h-find")
    wait_text(page, "#omni-h-table", prompt)
    wait_text(page, "#omni-h-count", "1 run(s) match")  # the count is its own output: it may come later
    page.locator("#omni-h-table").get_by_text(prompt).filter(visible=True).first.click()
    wait_text(page, "#omni-h-detail", prompt)
    page.get_by_role("button", name="Delete run").click()

    wait_text(page, "#omni-h-detail", f"Deleted run {run_id[:12]}")
    wait_text(page, "#omni-h-count", "0 run(s) match")
    assert prompt not in page.inner_text("#omni-h-table")
    assert page.locator("#omni-h-run-id textarea, #omni-h-run-id input").first.input_value() == ""
    # Searching again (a fresh list from the store) does not bring it back.
    page.click("#omni-h-find")
    wait_text(page, "#omni-h-count", "0 run(s) match")
    assert prompt not in page.inner_text("#omni-h-table")

    from studio.store import open_store
    from studio.store.errors import RunNotFound

    with open_store(None, studio.data_dir) as store, pytest.raises(RunNotFound):
        store.get_run(run_id)
    gone = httpx.get(output_url, timeout=30)  # its picture was its own: the file went with it
    assert gone.status_code == 404 and gone.json()["error"]["type"]


PRESET = "GLM-Image on 1 GPU"  # assets/deploy/glm-image-1gpu.yaml: 50 steps at 1024x1024, one sequence


def load_preset(page, name: str) -> None:
    open_tab(page, "Pipeline")
    page.wait_for_selector("#omni-stage1-output input")
    page.get_by_label("Preset").click()
    page.get_by_role("option", name=name, exact=True).click()
    page.get_by_role("button", name="Load preset").click()
    wait_text(page, "#omni-deploy-yaml", "num_inference_steps: 50")


def test_load_preset_puts_the_preset_in_the_editor_with_its_diff(page, studio):
    from engine.paths import DEPLOY_PRESETS_DIR

    load_preset(page, PRESET)
    editor = page.inner_text("#omni-deploy-yaml")
    for line in ("height: 1024", "width: 1024", "max_num_seqs: 1", "gpu_memory_utilization: 0.5"):
        assert line in editor, line
    assert (DEPLOY_PRESETS_DIR / "glm-image-1gpu.yaml").read_text().splitlines()[0] in editor
    diff = page.inner_text("#omni-deploy-diff")
    assert "+    num_inference_steps: 50" in diff and "-    num_inference_steps: 4" in diff
    # Loading is not applying: the studio still runs its own config.
    body = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={"messages": [{"role": "user", "content": "still tiny"}], "seed": 1},
    ).json()
    url = body["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert pixels(base64.b64decode(url.split(",", 1)[1])).shape == (64, 64, 3)


def form_field(page, label: str, nth: int = 0) -> str:
    """What the ``nth`` visible field labelled ``label...`` of the Pipeline tab's stage form shows (stage 0's
    form comes first)."""
    return page.get_by_label(re.compile("^" + re.escape(label))).filter(visible=True).nth(nth).input_value()


def test_load_preset_shows_the_presets_values_in_the_stage_form(page):
    load_preset(page, PRESET)
    assert form_field(page, "num_inference_steps") == "50"  # only the diffusion stage has these
    assert form_field(page, "height") == "1024" and form_field(page, "width") == "1024"
    assert form_field(page, "max_num_seqs", 0) == form_field(page, "max_num_seqs", 1) == "1"


def test_a_text_model_answers_in_text_in_the_chat(page, studio):
    """Pick the built-in text model (tiny-chat) in the Chat tab's model picker: the answer is text.
    Last in this module, and switches back: it changes the model the module's studio serves."""
    picker = page.locator("#omni-model input")
    picker.click()
    page.get_by_role("option", name="tiny-chat", exact=True).click()
    try:
        wait_text(page, "#omni-chat-status", "Now serving tiny-chat (chat)")
        prompt = f"say hello in five words {uuid.uuid4().hex[:8]}"
        send_prompt(page, prompt)
        # The run by its prompt in the store (the status line is shared with the model switch's messages).
        run = recorded(studio, lambda store: run_of_prompt(store, prompt))
        assert run.status == "succeeded" and run.model == "tiny-chat" and run.text
        answer = page.locator("#omni-chatbot [data-testid='bot']").last
        wait_text(page, "#omni-chatbot", run.text.strip())
        assert answer.inner_text().strip() == run.text.strip()
        assert page.locator("#omni-chatbot img").count() == 0  # text only, no picture
        assert not [o for o in run.outputs if o.kind == "image"]
    finally:
        picker.click()
        page.get_by_role("option", name="tiny-glm-image", exact=True).click()
        wait_text(page, "#omni-chat-status", "Now serving tiny-glm-image")
