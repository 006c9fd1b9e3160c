"""The Batch and Queue tabs in a real browser (headless Debian Chromium, Playwright) against `omni-studio ui`
on tiny-glm-shapes: submit grid jobs from the form, watch them in the Queue panel with their progress
next to another client's job, move one up, cancel one (not someone else's), and see the grid."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.servers import running_server

pytestmark = pytest.mark.browser

SHAPES = ["a red circle on a blue background, center", "a green square on a yellow background, top left"]


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    args = ["ui", "--model", "tiny-glm-shapes"]
    with running_server(args, tmp_path_factory.mktemp("queue-studio")) as server:
        yield server


def text_of(page, selector: str) -> str:
    return page.inner_text(selector)


def wait_text(page, selector: str, needle: str) -> None:
    page.wait_for_function(
        "([s, n]) => { const e = document.querySelector(s); return e && e.innerText.includes(n); }",
        arg=[selector, needle],
    )


def submit_form(page, name: str) -> None:
    page.fill("#omni-batch-name textarea, #omni-batch-name input", name)
    page.click("#omni-batch-submit")
    wait_text(page, "#omni-batch-status", "Submitted job")
    page.wait_for_function("n => document.querySelector('#omni-batch-jobs').innerText.includes(n)", arg=name)


def queue_row(page, name: str) -> str:
    """The Queue table's row (its text) that mentions ``name``."""
    for row in page.locator("#omni-queue-table [role=row]").all_inner_texts():  # Gradio 6: div rows
        if name in row:
            return row
    return ""


SELECTED = "document.querySelector('#omni-queue-selected textarea, #omni-queue-selected input').value"


def pick(page, name: str) -> None:
    """Select the job ``name`` in the table and wait until the selection holds it: a new job id (each pick
    here is another job), not the previous selection's id, which a cancel would otherwise act on."""
    before = page.evaluate(SELECTED)
    page.locator("#omni-queue-table").get_by_text(name, exact=True).filter(visible=True).first.click()
    page.wait_for_function(
        f"old => {{ const v = {SELECTED}; return v.length == 32 && v != old; }}", arg=before
    )


def test_submit_watch_reorder_cancel_and_see_the_grid(page, studio):
    # Another client's long job holds the runner, so the jobs submitted below wait in the queue.
    long_job = httpx.post(
        studio.url + "/v1/studio/jobs",
        json={
            "name": "long api job",
            "prompts": SHAPES,
            "seeds": list(range(8)),
            "size": "128x128",  # the model's own size: ~1 s a cell here, so it outlasts the clicks below
            "x": {"param": "steps", "values": [1, 2, 3, 4, 5, 6, 7, 8]},
        },
        timeout=60,
    ).json()
    try:
        page.get_by_role("tab", name="Batch").click()
        wait_text(page, "#omni-batch-jobs", "long api job")
        # A bad value is refused with the field and what is allowed; nothing is queued.
        page.fill("#omni-batch-x-values textarea, #omni-batch-x-values input", "1.0, lots")
        page.click("#omni-batch-submit")
        wait_text(page, "#omni-batch-status", "x.values[1]")
        assert "guidance must be a number from 0 to 100, got 'lots'" in text_of(page, "#omni-batch-status")
        page.fill("#omni-batch-x-values textarea, #omni-batch-x-values input", "1.0, 3.0")
        submit_form(page, "first ui job")
        submit_form(page, "second ui job")

        page.get_by_role("tab", name="Queue").click()  # its table refreshes itself while it is shown
        wait_text(page, "#omni-queue-table", "second ui job")
        running = queue_row(page, "long api job")
        assert "running" in running and "API 127.0.0.1" in running and "#1" in running
        assert "#2" in queue_row(page, "first ui job") and "(you)" in queue_row(page, "first ui job")
        assert "#3" in queue_row(page, "second ui job")
        wait_text(page, "#omni-queue-table", "job " + long_job["id"][:8] + " cell")  # its cells in the engine
        done = int(re.search(r"(\d+)/128 cells", queue_row(page, "long api job")).group(1))
        page.wait_for_function(
            "n => { const m = document.querySelector('#omni-queue-table').innerText.match(/(\\d+)\\/128 cells/);"
            " return m && Number(m[1]) > n; }",
            arg=done,
            timeout=180_000,  # a batch of cells at 128x128 on a busy machine
        )  # the progress moves without a click

        pick(page, "second ui job")
        page.click("#omni-queue-up")
        wait_text(page, "#omni-queue-status", "is now #2 in the queue")
        page.wait_for_function(
            "() => { const t = document.querySelector('#omni-queue-table').innerText;"
            " return t.indexOf('second ui job') < t.indexOf('first ui job'); }"
        )
        assert "#2" in queue_row(page, "second ui job") and "#3" in queue_row(page, "first ui job")

        pick(page, "long api job")
        page.click("#omni-queue-cancel")
        wait_text(page, "#omni-queue-status", "only its owner or the admin login can cancel it")
        assert "running" in queue_row(page, "long api job")

        pick(page, "first ui job")
        page.click("#omni-queue-cancel")
        wait_text(page, "#omni-queue-status", "Cancelled job first ui job")
        page.wait_for_function(
            "!document.querySelector('#omni-queue-table').innerText.includes('first ui job')"
        )
    finally:
        httpx.delete(f"{studio.url}/v1/studio/jobs/{long_job['id']}", timeout=60)

    # The runner moves on to the second job; the Batch tab shows its grid once every cell has run.
    page.get_by_role("tab", name="Batch").click()
    page.locator("#omni-batch-jobs").get_by_text("second ui job", exact=True).filter(
        visible=True
    ).first.click()
    wait_text(page, "#omni-batch-detail", "second ui job")
    page.wait_for_selector("#omni-batch-grid img", timeout=180_000)
    wait_text(page, "#omni-batch-detail", "succeeded")
    assert "4/4 cells done: 4 succeeded" in text_of(page, "#omni-batch-detail")
    grid_src = page.get_attribute("#omni-batch-grid img", "src")
    assert (
        grid_src
        and httpx.get(grid_src if grid_src.startswith("http") else studio.url + grid_src).status_code == 200
    )
    jobs = httpx.get(studio.url + "/v1/studio/jobs", timeout=30).json()["data"]
    states = {job["name"]: job["status"] for job in jobs}
    assert states == {"second ui job": "succeeded", "first ui job": "cancelled", "long api job": "cancelled"}
    page.get_by_role("tab", name="Queue").click()
    wait_text(page, "#omni-queue-who", "Nothing is queued or running")
