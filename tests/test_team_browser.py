"""A team studio in a real browser (headless Debian Chromium, Playwright) against `omni-studio ui` with
accounts (docs/team.md): each user logs in with their own name, sees who is logged in and can log out; a
wrong password is refused; each user's History shows their own runs only (from the Chat and from their API
key), and the admin's shows everyone's with their owners. A user makes and revokes their own API key in the
Serving tab.

With ``OMNI_STUDIO_SCREENSHOT_DIR`` set, two users' History side by side is saved there as
``team-history.png`` (docs/screenshots/ holds the one in the docs).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageDraw

from studio.cli import main
from tests.browser import TIMEOUT_MS, open_tab, send_prompt
from tests.servers import running_server

pytestmark = pytest.mark.browser
PASSWORD = "a long enough password"
GEN = {"height": 64, "width": 64, "num_inference_steps": 2, "response_format": "b64_json"}


@pytest.fixture(scope="module")
def studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    data = tmp_path_factory.mktemp("team") / "data"
    data.mkdir()
    password = data.parent / "pw"
    password.write_text(PASSWORD + "\n")
    for name, admin in (("alice", []), ("bob", []), ("root", ["--admin"])):
        assert (
            main(["users", "add", name, *admin, "--password-file", str(password), "--data-dir", str(data)])
            == 0
        )
    with running_server(["ui"], data) as server:
        yield server


def wait_text(page: Any, selector: str, needle: str) -> None:
    page.wait_for_function(
        "([s, n]) => (document.querySelector(s)?.innerText || '').includes(n)", arg=[selector, needle]
    )


def log_in(browser: Any, url: str, name: str, password: str = PASSWORD) -> Any:
    """A fresh browser context logged in as ``name``; its page, on the Chat tab."""
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url + "/")
    page.locator("input[type=text]").first.fill(name)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#omni-message textarea")
    wait_text(page, "#omni-who", f"Logged in as {name}")
    return page


def chat(page: Any, prompt: str) -> None:
    send_prompt(page, prompt)
    wait_text(page, "#omni-chat-status", "Done in")


def history_text(page: Any, needle: str) -> str:
    open_tab(page, "History")
    wait_text(page, "#omni-h-table", needle)
    return page.inner_text("#omni-h-table")


def test_a_wrong_password_is_refused_and_a_user_logs_in_and_out(browser: Any, studio: Any) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(studio.url + "/")
    page.locator("input[type=text]").first.fill("alice")
    page.locator("input[type=password]").first.fill("not her password")
    page.get_by_role("button", name="Login").click()
    page.get_by_text("Incorrect Credentials", exact=False).wait_for()
    assert page.locator("#omni-message").count() == 0
    context.close()

    page = log_in(browser, studio.url, "alice")
    assert page.inner_text("#omni-who").strip() == "Logged in as alice"
    page.click("#omni-logout")
    page.get_by_role("button", name="Login").wait_for()  # back at the login page
    page.goto(studio.url + "/")
    page.get_by_role("button", name="Login").wait_for()  # and the cookie is gone
    page.context.close()

    root = log_in(browser, studio.url, "root")
    assert root.inner_text("#omni-who").strip() == "Logged in as root (admin)"
    root.context.close()


def test_each_user_sees_their_own_history_and_the_admin_all(browser: Any, studio: Any) -> None:
    alice = log_in(browser, studio.url, "alice")
    bob = log_in(browser, studio.url, "bob")
    try:
        chat(alice, "alice's red circle")
        chat(bob, "bob's blue square")
        # Bob's API key: his API runs are his too, in the same History.
        open_tab(bob, "Serving")
        bob.fill("#omni-key-label textarea, #omni-key-label input", "laptop")
        bob.click("#omni-key-create")
        wait_text(bob, "#omni-keys-status", "Made key")
        key = bob.locator("#omni-new-key textarea, #omni-new-key input").first.input_value()
        assert key.startswith("omni_")
        wait_text(bob, "#omni-keys-table", "laptop")
        reply = httpx.post(
            f"{studio.url}/v1/images/generations",
            json={**GEN, "prompt": "bob's green triangle", "seed": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        Image.open(io.BytesIO(base64.b64decode(reply.json()["data"][0]["b64_json"]))).verify()

        mine = history_text(alice, "alice's red circle")
        assert "bob's" not in mine
        theirs = history_text(bob, "bob's green triangle")
        assert "bob's blue square" in theirs and "alice's" not in theirs
        target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
        if target:
            side_by_side(alice, bob, Path(target) / "team-history.png")
        # Alice's Serving tab lists none of bob's keys.
        open_tab(alice, "Serving")
        wait_text(alice, "#omni-keys-intro", "Logged in as alice")
        assert "laptop" not in alice.inner_text("#omni-keys-table")

        # Bob revokes his key in the Serving tab: the API refuses it from the next request.
        key_id = key.split("_")[1]
        open_tab(bob, "Serving")
        bob.fill("#omni-key-id textarea, #omni-key-id input", key_id)
        bob.click("#omni-key-revoke")
        wait_text(bob, "#omni-keys-status", f"Revoked key {key_id}")
        refused = httpx.get(f"{studio.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert refused.status_code == 401

        root = log_in(browser, studio.url, "root")
        everyone = history_text(root, "bob's green triangle")
        assert "alice's red circle" in everyone and "bob's blue square" in everyone
        assert "owner" in everyone and "alice" in everyone and "bob" in everyone

        # The admin manages the accounts in the Serving tab: a new user logs in at once.
        open_tab(root, "Serving")
        root.click("#omni-users button")  # the accordion
        wait_text(root, "#omni-users-table", "alice")
        root.fill("#omni-user-name textarea, #omni-user-name input", "carol")
        root.fill("#omni-user-password input, #omni-user-password textarea", "carol's passphrase")
        root.click("#omni-user-add")
        wait_text(root, "#omni-users-status", "Added user carol")
        carol = log_in(browser, studio.url, "carol", "carol's passphrase")
        open_tab(carol, "History")  # a new user's History is empty: nobody else's runs
        wait_text(carol, "#omni-h-count", "0 run(s) match")
        carol.context.close()
        root.context.close()
        # A user may not.
        open_tab(alice, "Serving")
        alice.click("#omni-users button")
        alice.fill("#omni-user-name textarea, #omni-user-name input", "mallory")
        alice.fill("#omni-user-password input, #omni-user-password textarea", "mallory's passphrase")
        alice.click("#omni-user-add")
        wait_text(alice, "#omni-users-status", "Only an admin may manage accounts")
    finally:
        alice.context.close()
        bob.context.close()


def side_by_side(left: Any, right: Any, path: Path) -> None:
    """Two pages' History, each under its user's name, in one picture."""
    shots = []
    for page in (left, right):
        page.evaluate("window.scrollTo(0, 0)")  # who is logged in, the filters and the table
        page.wait_for_timeout(500)
        shots.append(Image.open(io.BytesIO(page.screenshot())).convert("RGB"))
    gap = 16
    width = sum(s.width for s in shots) + gap
    picture = Image.new("RGB", (width, max(s.height for s in shots)), "white")
    x = 0
    for shot in shots:
        picture.paste(shot, (x, 0))
        x += shot.width + gap
    ImageDraw.Draw(picture).line(
        [(shots[0].width + gap // 2, 0), (shots[0].width + gap // 2, picture.height)], fill="#999", width=2
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
