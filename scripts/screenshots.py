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

from tests.servers import running_server  # noqa: E402

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--only", choices=("recipe-drop",), default=None, help="make just this screenshot")
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
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(server.url + "/")
        page.wait_for_selector("#omni-message textarea")
        if args.only == "recipe-drop":
            shoot_recipe_drop(page, server.url, args.out)
            browser.close()
            print(args.out / "recipe-drop.png")
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
        browser.close()
    for path in sorted(args.out.glob("*.png")):
        print(path)


if __name__ == "__main__":
    main()
