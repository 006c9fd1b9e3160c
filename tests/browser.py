"""What every browser test shares: Debian's Chromium driven by Playwright (never ``playwright install``).

``tests/conftest.py`` turns these into the ``browser`` (one per module) and ``page`` (a fresh context on
the module's ``studio`` server, Chat tab loaded) fixtures.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def studio_page(browser: Any, url: str) -> Iterator[Any]:
    """A page on the studio at ``url`` in a fresh context, once the Chat tab's message box is there."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url + "/")
        page.wait_for_selector("#omni-message textarea")
        yield page
    finally:
        context.close()


def open_tab(page: Any, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def set_number(page: Any, elem_id: str, value: str) -> None:
    """Type ``value`` into the number box of the component ``elem_id`` and commit it (Enter)."""
    box = page.locator(f"#{elem_id} input[type=number]").first
    box.fill(value)
    box.press("Enter")


def send_prompt(page: Any, prompt: str) -> None:
    """Send ``prompt`` from the Chat tab's message box."""
    page.fill("#omni-message textarea", prompt)
    page.keyboard.press("Enter")
