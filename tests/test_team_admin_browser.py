"""What only an admin does in a team studio, in a real browser (headless Debian Chromium, Playwright)
against `omni-studio ui` with accounts (docs/team.md, "What only an admin does"): a user's Apply, model
switch and the same calls through Gradio's HTTP API are refused, naming who may and who is logged in, and
the engine keeps serving what it served; the admin's Apply rebuilds it. A recipe dropped on the Chat tab
restores its parameters for anyone but names only the visitor's own runs (the admin's: every run, with
its owner). A user's own key, or their UI login, reads /metrics.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.cli import main
from tests.browser import TIMEOUT_MS, open_tab
from tests.servers import running_server

pytestmark = pytest.mark.browser
PASSWORD = "a long enough password"
GEN = {"height": 64, "width": 64, "num_inference_steps": 2, "response_format": "b64_json"}


class Team:
    def __init__(self, url: str, keys: dict[str, str]) -> None:
        self.url = url
        self.keys = keys

    def bearer(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[name]}"}


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    data = tmp_path_factory.mktemp("team-admin") / "data"
    data.mkdir()
    password = data.parent / "pw"
    password.write_text(PASSWORD + "\n")
    keys = {}
    for name, admin in (("alice", []), ("bob", []), ("root", ["--admin"])):
        args = ["--data-dir", str(data)]
        assert main(["users", "add", name, *admin, "--password-file", str(password), *args]) == 0
    key_file = data.parent / "keys"
    for name in ("alice", "bob"):
        with key_file.open("w") as out, pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stdout", out)
            assert main(["keys", "create", "--user", name, "--data-dir", str(data)]) == 0
        keys[name] = key_file.read_text().splitlines()[-1]
    with running_server(["ui"], data) as server:
        yield Team(server.url, keys)


def wait_text(page: Any, selector: str, needle: str) -> None:
    page.wait_for_function(
        "([s, n]) => (document.querySelector(s)?.innerText || '').includes(n)", arg=[selector, needle]
    )


def log_in(browser: Any, url: str, name: str) -> Any:
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url + "/")
    page.locator("input[type=text]").first.fill(name)
    page.locator("input[type=password]").first.fill(PASSWORD)
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#omni-message textarea")
    wait_text(page, "#omni-who", f"Logged in as {name}")
    return page


def header_hash(page: Any) -> str:
    found = re.search(r"config (\w{8})", page.inner_text("#omni-header"))
    assert found, page.inner_text("#omni-header")
    return found.group(1)


def set_steps_in_yaml(page: Any, steps: str) -> None:
    """The diffusion stage's default steps, through the stage form (Form -> YAML)."""
    open_tab(page, "Pipeline")
    box = page.get_by_label(re.compile(r"^num_inference_steps")).first
    box.fill(steps)
    page.click("#omni-form-to-yaml")
    wait_text(page, "#omni-deploy-yaml", f"num_inference_steps: {steps}")


def gradio_call(url: str, name: str, api_name: str, data: list[Any]) -> str:
    """Call a UI event through Gradio's HTTP API, logged in as ``name``; the event stream's text."""
    with httpx.Client(base_url=url, timeout=120) as client:
        login = client.post("/login", data={"username": name, "password": PASSWORD})
        assert login.status_code == 200, login.text
        call = client.post(f"/gradio_api/call/{api_name}", json={"data": data})
        assert call.status_code == 200, call.text
        return client.get(f"/gradio_api/call/{api_name}/{call.json()['event_id']}").text


def test_a_user_may_not_apply_or_switch_the_model_and_the_admin_may(browser: Any, team: Team) -> None:
    bob = log_in(browser, team.url, "bob")
    root = None
    try:
        running = header_hash(bob)
        models = httpx.get(f"{team.url}/v1/models", headers=team.bearer("bob"), timeout=30).json()
        model = models["data"][0]["id"]
        set_steps_in_yaml(bob, "7")
        bob.click("#omni-validate")  # Validate stays open to everyone
        bob.wait_for_selector("#omni-pipeline-result .omni-ok")
        assert "Valid." in bob.inner_text("#omni-pipeline-result")
        bob.click("#omni-apply")
        wait_text(bob, "#omni-pipeline-result", "Not applied")
        refused = bob.inner_text("#omni-pipeline-result")
        assert "only an admin can apply a deploy config; logged in as bob" in refused
        assert header_hash(bob) == running
        edited = bob.inner_text("#omni-deploy-yaml")  # bob's edit (steps 7), sent again below

        # The model picker: refused, and the picker shows the running model again.
        open_tab(bob, "Chat")
        bob.locator("#omni-model input").click()
        bob.get_by_role("option", name="tiny-chat", exact=True).click()
        wait_text(bob, "#omni-chat-status", "only an admin can switch the model; logged in as bob")
        bob.wait_for_function(
            "m => document.querySelector('#omni-model input').value === m", arg=model, timeout=TIMEOUT_MS
        )
        assert "Now serving" not in bob.inner_text("#omni-chat-status")

        # The same events through Gradio's HTTP API, logged in as bob: refused the same way.
        stream = gradio_call(team.url, "bob", "apply_config", [edited])
        assert "only an admin can apply a deploy config; logged in as bob" in stream, stream[-2000:]
        stream = gradio_call(team.url, "bob", "switch_model", ["tiny-chat"])
        assert "only an admin can switch the model; logged in as bob" in stream, stream[-2000:]
        after = httpx.get(f"{team.url}/v1/models", headers=team.bearer("bob"), timeout=30).json()
        assert after["data"][0]["id"] == model  # still the same model
        bob.reload()
        bob.wait_for_selector("#omni-message textarea")
        assert header_hash(bob) == running  # and the same config

        # The admin's Apply rebuilds the engine: the header names the new config.
        root = log_in(browser, team.url, "root")
        set_steps_in_yaml(root, "7")
        root.click("#omni-apply")
        root.wait_for_selector("#omni-pipeline-result .omni-ok")
        assert "Applied" in root.inner_text("#omni-pipeline-result")
        root.wait_for_function(
            "h => !document.querySelector('#omni-header').innerText.includes(h)", arg=running
        )
    finally:
        bob.context.close()
        if root is not None:
            root.context.close()


def test_a_dropped_recipe_names_only_the_visitors_own_runs(browser: Any, team: Team, tmp_path: Path) -> None:
    reply = httpx.post(
        f"{team.url}/v1/images/generations",
        json={**GEN, "prompt": "alice's recipe circle", "seed": 31},
        headers=team.bearer("alice"),
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    run_id = reply.headers["X-Run-Id"]
    made = tmp_path / "alices.png"
    made.write_bytes(base64.b64decode(reply.json()["data"][0]["b64_json"]))

    def dropped(name: str) -> tuple[Any, str]:
        page = log_in(browser, team.url, name)
        page.set_input_files("#omni-recipe input[type=file]", str(made))
        wait_text(page, "#omni-recipe-note", "Restored")
        # The recipe itself loads for anyone: the prompt and the seed are back in the form.
        assert page.input_value("#omni-message textarea") == "alice's recipe circle"
        assert page.locator("#omni-seed input[type=number]").first.input_value() == "31"
        return page, page.inner_text("#omni-recipe-note")

    alice, note = dropped("alice")
    alice.context.close()
    assert f"This file is an output of run {run_id[:12]}" in note, note
    assert "(alice)" not in note  # a user's own runs need no owner

    bob, note = dropped("bob")
    bob.context.close()
    assert run_id[:12] not in note, note
    assert "None of your runs made this file." in note

    root, note = dropped("root")
    root.context.close()
    assert f"This file is an output of run {run_id[:12]} (alice)" in note, note


def test_a_users_key_or_login_reads_the_metrics(team: Team) -> None:
    refused = httpx.get(f"{team.url}/metrics", timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(
        f"{team.url}/metrics", headers={"Authorization": "Bearer omni_0123456789_x"}, timeout=30
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for name in ("alice", "bob"):
        reply = httpx.get(f"{team.url}/metrics", headers=team.bearer(name), timeout=30)
        assert reply.status_code == 200, reply.text
        assert "omni_studio_requests_in_flight" in reply.text
    with httpx.Client(base_url=team.url, timeout=30) as client:
        assert client.post("/login", data={"username": "bob", "password": PASSWORD}).status_code == 200
        assert client.get("/metrics").status_code == 200
