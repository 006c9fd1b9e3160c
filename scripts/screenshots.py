"""Screenshots of each studio tab at 1400x1000 for the README (docs/screenshots/*.png).

Starts `omni-studio ui` on the tiny pipeline in a throwaway data dir, makes a few runs (UI and API) so
every tab has something to show, and drives Debian's chromium headless through Playwright.

    .venv/bin/python scripts/screenshots.py [--model tiny-glm-image] [--out docs/screenshots] [--only recipe-drop]
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tests.servers import running_server  # noqa: E402


def shoot_recipe_drop(page, url: str, out: Path) -> None:
    """recipe-drop.png: a PNG made by the API, dropped on the Chat tab's "Load recipe from PNG" (docs/recipes.md)."""
    body = {
        "messages": [{"role": "user", "content": "a red circle on a blue background, top left"}],
        "seed": 4242,
        "num_inference_steps": 6,
        "guidance_scale": 2.5,
        "negative_prompt": "blurry, dark",
    }
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, json=body).json()
    data_url = reply["choices"][0]["message"]["content"][-1]["image_url"]["url"]
    made = Path(tempfile.mkdtemp()) / "made-in-the-studio.png"
    made.write_bytes(base64.b64decode(data_url.split(",", 1)[1]))
    page.goto(url + "/")
    page.wait_for_selector("#omni-message textarea")
    page.set_input_files("#omni-recipe input[type=file]", str(made))
    page.wait_for_function("document.querySelector('#omni-recipe-note').innerText.includes('Restored')")
    page.set_viewport_size({"width": 1400, "height": 1500})  # the whole restored form
    page.wait_for_timeout(800)
    page.screenshot(path=str(out / "recipe-drop.png"))
    page.set_viewport_size({"width": 1400, "height": 1000})


SHAPES = (
    "a red circle on a blue background, center",
    "a yellow square on a purple background, top left",
    "a green triangle on a cyan background, bottom right",
)


def shoot_jobs(page, url: str, out: Path) -> None:
    """queue.png: the Queue panel with an API job running (its cells in the engine) and two jobs from the
    Batch tab waiting; grid.png: the Batch tab with a finished job's grid (docs/jobs.md)."""
    long_job = httpx.post(
        url + "/v1/studio/jobs",
        timeout=60,
        json={
            "name": "shapes x seeds (API)",
            "prompts": list(SHAPES),
            "seeds": list(range(1, 9)),
            "x": {"param": "steps", "values": [4, 8]},
        },
    ).json()
    page.goto(url + "/")
    page.wait_for_selector("#omni-message textarea")
    page.get_by_role("tab", name="Batch").click()
    page.fill("#omni-batch-prompts textarea", "\n".join(SHAPES[:2]))
    page.fill("#omni-batch-size textarea, #omni-batch-size input", "")
    page.fill("#omni-batch-x-values textarea, #omni-batch-x-values input", "1.0, 1.5, 3.0")
    page.fill("#omni-batch-y-values textarea, #omni-batch-y-values input", "4, 8")
    for name in ("guidance x steps", "guidance x steps, again"):
        page.fill("#omni-batch-name textarea, #omni-batch-name input", name)
        page.click("#omni-batch-submit")
        page.wait_for_function(
            "n => document.querySelector('#omni-batch-jobs').innerText.includes(n)", arg=name
        )
    page.get_by_role("tab", name="Queue").click()
    page.wait_for_function("document.querySelector('#omni-queue-table').innerText.includes('again')")
    page.wait_for_timeout(2500)
    page.screenshot(path=str(out / "queue.png"))
    httpx.delete(f"{url}/v1/studio/jobs/{long_job['id']}", timeout=60)
    page.get_by_role("tab", name="Batch").click()
    page.locator("#omni-batch-jobs").get_by_text("guidance x steps", exact=True).filter(
        visible=True
    ).first.click()
    page.wait_for_selector("#omni-batch-grid img", timeout=300_000)
    page.wait_for_timeout(1500)
    page.locator("#omni-batch-detail").scroll_into_view_if_needed()
    page.screenshot(path=str(out / "grid.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument(
        "--only",
        choices=("recipe-drop", "jobs"),
        default=None,
        help="make just this screenshot (jobs: queue.png and grid.png, best with --model tiny-glm-shapes)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--model", args.model] if args.model else []
    from playwright.sync_api import sync_playwright

    with running_server(["ui", *extra], Path(tempfile.mkdtemp())) as server, sync_playwright() as p:
        for seed, prompt in (
            (1, "a red circle on a blue background, top left"),
            (2, "a yellow square on a purple background, center"),
        ):
            httpx.post(
                server.url + "/v1/chat/completions",
                timeout=120,
                json={"messages": [{"role": "user", "content": prompt}], "seed": seed},
            )
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(server.url + "/")
        page.wait_for_selector("#omni-message textarea")
        if args.only == "recipe-drop":
            shoot_recipe_drop(page, server.url, args.out)
            browser.close()
            print(args.out / "recipe-drop.png")
            return
        if args.only == "jobs":
            shoot_jobs(page, server.url, args.out)
            browser.close()
            print(args.out / "queue.png", args.out / "grid.png")
            return
        page.fill("#omni-message textarea", "a green triangle on a cyan background, bottom right")
        page.keyboard.press("Enter")
        page.wait_for_selector("#omni-chatbot img")
        page.wait_for_timeout(500)
        page.screenshot(path=str(args.out / "chat.png"))

        page.get_by_role("tab", name="Pipeline").click()
        page.wait_for_timeout(2000)  # the tab refreshes itself when opened
        output = page.locator("#omni-stage1-output input")
        if output.count():
            output.fill("images")
            output.press("Enter")
            page.click("#omni-form-to-yaml")
            page.wait_for_timeout(800)
            page.click("#omni-validate")
            page.wait_for_selector("#omni-pipeline-result .omni-invalid")
        page.wait_for_timeout(500)
        page.screenshot(path=str(args.out / "pipeline.png"))

        page.get_by_role("tab", name="Serving").click()
        page.wait_for_timeout(800)
        page.screenshot(path=str(args.out / "serving.png"))

        page.get_by_role("tab", name="History").click()
        page.wait_for_selector("#omni-h-table")
        page.wait_for_timeout(1500)
        page.locator("#omni-h-table").get_by_text("a red circle").filter(visible=True).first.click()
        page.wait_for_function("document.querySelector('#omni-h-detail').innerText.includes('a red circle')")
        page.wait_for_timeout(1000)
        page.locator("#omni-h-run-id").scroll_into_view_if_needed()
        page.mouse.wheel(0, 250)
        page.wait_for_timeout(800)
        page.screenshot(path=str(args.out / "history.png"))

        page.get_by_role("tab", name="System").click()
        page.wait_for_timeout(800)
        page.screenshot(path=str(args.out / "system.png"))

        shoot_recipe_drop(page, server.url, args.out)
        shoot_jobs(page, server.url, args.out)
        browser.close()
    for path in sorted(args.out.glob("*.png")):
        print(path)


if __name__ == "__main__":
    main()
