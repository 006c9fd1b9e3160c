"""The History tab's replay action in a real browser (headless Debian Chromium, Playwright) against
`omni-studio ui --model tiny-glm-shapes` on 127.0.0.1: replaying the selected run reports it identical;
after applying a deploy config with fewer diffusion steps, replaying the filter's runs reports them changed
and shows each changed pair in the before/after slider.

With ``OMNI_STUDIO_SCREENSHOT_DIR`` set, the report and slider are saved there as ``replay.png`` (how
docs/screenshots/replay.png is made; docs/replay.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.browser import open_tab
from tests.servers import running_server

pytestmark = pytest.mark.browser

PROMPTS = (
    (21, "a red circle on a blue background, top left"),
    (22, "a yellow square on a purple background, center"),
)


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(["ui", "--model", "tiny-glm-shapes"], tmp_path_factory.mktemp("replay-ui")) as server:
        for seed, prompt in PROMPTS:
            response = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=120,
                json={"messages": [{"role": "user", "content": prompt}], "seed": seed},
            )
            assert response.status_code == 200, response.text
        yield server


def wait_for_text(page, selector: str, text: str) -> None:
    page.wait_for_function(
        "([selector, text]) => (document.querySelector(selector)?.innerText || '').includes(text)",
        arg=[selector, text],
    )


def click_radio(page, elem_id: str, label: str) -> None:
    page.locator(f"#{elem_id}").get_by_text(label, exact=True).click()


def test_replay_from_history_reports_identical_then_changed_with_a_slider(page, studio):
    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", "red circle")
    page.click("#omni-h-find")
    wait_for_text(page, "#omni-h-table", "a red circle")
    page.locator("#omni-h-table").get_by_text("a red circle").filter(visible=True).first.click()
    wait_for_text(page, "#omni-h-detail", "a red circle")

    # the selected run, on the running engine, with its recorded parameters: identical
    page.click("#omni-h-replay")
    wait_for_text(page, "#omni-h-replay-report", "Summary:")
    report = page.inner_text("#omni-h-replay-report")
    assert "1 run: 1 identical, 0 changed, 0 failed" in report
    assert "the running engine: tiny-glm-shapes" in report
    assert not page.locator("#omni-h-replay-slider").is_visible()  # nothing changed, nothing to slide

    # a deploy config with 2 diffusion steps instead of 8, applied from the Pipeline tab
    open_tab(page, "Pipeline")
    steps_box = page.get_by_label(re.compile(r"^num_inference_steps")).first
    steps_box.fill("2")
    page.click("#omni-form-to-yaml")
    wait_for_text(page, "#omni-deploy-yaml", "num_inference_steps: 2")
    page.click("#omni-apply")
    page.wait_for_selector("#omni-pipeline-result .omni-ok")

    # every run the (now empty) filter matches, with the config's defaults: both changed
    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", "")
    click_radio(page, "omni-h-replay-scope", "the runs matching the filters")
    click_radio(page, "omni-h-replay-params", "config")
    page.click("#omni-h-replay")
    wait_for_text(page, "#omni-h-replay-report", "Summary: 2 runs")
    report = page.inner_text("#omni-h-replay-report")
    assert "2 runs: 0 identical, 2 changed, 0 failed" in report
    assert "2 runs matching status succeeded, not replays" in report  # the first replay is not replayed
    assert "num_inference_steps: 8 -> 2" in report
    assert re.search(r"changed\s+\d+\s+\d+\.\d{3}\s+\d+\.\d{2}", report)  # max, mean difference, PSNR

    slider = page.locator("#omni-h-replay-slider")
    slider.scroll_into_view_if_needed()
    page.wait_for_function("document.querySelectorAll('#omni-h-replay-slider img').length >= 2")
    sources = page.eval_on_selector_all("#omni-h-replay-slider img", "imgs => imgs.map(i => i.src)")
    assert len(set(sources)) == 2  # before and after are two different images
    assert page.locator("#omni-h-replay-pair").is_visible()
    files = " ".join(page.inner_text("#omni-h-replay-files").split())  # the name and extension are apart
    assert "replay-report .md" in files and "replay-report .json" in files

    target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
    if target:
        page.evaluate("document.querySelector('#omni-h-replay-intro').scrollIntoView()")
        page.wait_for_timeout(800)
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / "replay.png"))
