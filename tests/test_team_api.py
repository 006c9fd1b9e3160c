"""A team studio's API (docs/team.md): each user's own key, their runs recorded as theirs, another user's
output files answering 404, the admin seeing everything, and a key revoked from the CLI refused at once by
the running server. A live `omni-studio serve` on SQLite and on PostgreSQL; plus the queue's and the fair
scheduler's view of users, in process."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import httpx
import pytest

pytest.register_assert_rewrite("conftest_store")

from conftest_store import new_database_url  # noqa: E402

from studio.accounts.identity import Identity, act_as, stop_acting  # noqa: E402
from studio.cli import main  # noqa: E402
from studio.runs.inflight import RequestBoard  # noqa: E402
from studio.runs.queue import QueueView, Viewer  # noqa: E402
from studio.runs.service import RunService  # noqa: E402
from tests.servers import running_server  # noqa: E402

pytest_plugins = ["conftest_store"]
GEN = {
    "model": "tiny-glm-image",
    "height": 64,
    "width": 64,
    "num_inference_steps": 2,
    "response_format": "b64_json",
}


def cli(capsys: pytest.CaptureFixture, db: str, data: Path, *args: str) -> str:
    code = main([*args, "--db", db, "--data-dir", str(data)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def make_team(capsys: pytest.CaptureFixture, db: str, data: Path) -> dict[str, str]:
    """alice and bob, and root the admin, each with a key; returns their keys."""
    password = data.parent / "pw"
    password.write_text("a long enough password\n")
    keys = {}
    for name in ("alice", "bob", "root"):
        admin = ["--admin"] if name == "root" else []
        cli(capsys, db, data, "users", "add", name, *admin, "--password-file", str(password))
        keys[name] = cli(capsys, db, data, "keys", "create", "--user", name).splitlines()[-1]
    return keys


def generate(url: str, key: str, prompt: str, seed: int) -> tuple[httpx.Response, str | None]:
    """An image as ``key``'s user; the response and the sha256 of its PNG (the output file's name)."""
    response = httpx.post(
        f"{url}/v1/images/generations",
        json={**GEN, "prompt": prompt, "seed": seed},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    if response.status_code != 200:
        return response, None
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    return response, hashlib.sha256(png).hexdigest()


def output(url: str, key: str, sha: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/outputs/{sha}.png", headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_each_user_has_their_own_key_runs_and_files_and_a_revoke_takes_effect_at_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = new_database_url(backend, tmp_path, request)
    keys = make_team(capsys, db, data)
    with running_server(["serve", "--db", db], data) as server:
        url = server.url
        # With accounts the API needs a key: none, or a wrong one, is a 401 naming why.
        refused = httpx.post(f"{url}/v1/images/generations", json={**GEN, "prompt": "x"}, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        wrong, _ = generate(url, keys["alice"][:-2] + "zz", "a fox", 1)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

        reply, alice_sha = generate(url, keys["alice"], "alice's red circle", 11)
        assert reply.status_code == 200, reply.text
        alice_run = reply.headers["X-Run-Id"]
        reply, bob_sha = generate(url, keys["bob"], "bob's blue square", 22)
        assert reply.status_code == 200, reply.text
        assert alice_sha and bob_sha and alice_sha != bob_sha

        # Each user reads their own output file; the other's answers 404, as a file that does not exist.
        assert output(url, keys["alice"], alice_sha).status_code == 200
        assert output(url, keys["bob"], bob_sha).status_code == 200
        hidden = output(url, keys["bob"], alice_sha)
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "file_not_found"
        assert output(url, keys["alice"], bob_sha).status_code == 404
        # The admin reads both.
        assert output(url, keys["root"], alice_sha).status_code == 200
        assert output(url, keys["root"], bob_sha).status_code == 200

        # A request refused before it ran is recorded too, as its user's.
        refused = httpx.post(
            f"{url}/v1/images/generations",
            json={**GEN, "prompt": "alice's refused one", "num_inference_steps": 10**6},
            headers={"Authorization": f"Bearer {keys['alice']}"},
            timeout=60,
        )
        assert refused.status_code == 400, refused.text

        # A job sent with alice's key is alice's: bob neither lists, reads nor cancels it; the admin sees it.
        def jobs(key: str, path: str = "", method: str = "GET", **kw) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.request(method, f"{url}/v1/studio/jobs{path}", headers=headers, timeout=60, **kw)

        spec = {"name": "alice job", "prompts": ["alice grid"], "seeds": [5], "size": "64x64", "steps": 2}
        job = jobs(keys["alice"], method="POST", json=spec).json()
        assert job["owner"] == "user:alice", job
        assert [j["id"] for j in jobs(keys["alice"]).json()["data"]] == [job["id"]]
        assert jobs(keys["bob"]).json()["data"] == []
        assert jobs(keys["bob"], f"/{job['id']}").status_code == 404
        assert jobs(keys["bob"], f"/{job['id']}", "DELETE").status_code == 404
        assert [j["id"] for j in jobs(keys["root"]).json()["data"]] == [job["id"]]
        deadline = time.monotonic() + 300  # only stops a hang: the job's one cell takes a second or two
        while jobs(keys["alice"], f"/{job['id']}").json()["status"] != "succeeded":
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.2)

        # The runs are recorded as their users' (the CLI reads the same store while the server runs).
        listed = json.loads(cli(capsys, db, data, "history", "ls", "--json"))
        owners = {run["prompt"]: run["owner"] for run in listed}
        assert owners["alice's red circle"] == "alice" and owners["bob's blue square"] == "bob"
        mine = json.loads(cli(capsys, db, data, "history", "ls", "--json", "--user", "alice"))
        assert alice_run in [run["id"] for run in mine] and {run["owner"] for run in mine} == {"alice"}
        assert "alice grid" in {run["prompt"] for run in mine}  # the job's cell: alice's run too
        assert "alice's refused one" in {run["prompt"] for run in mine}

        # Revoked from the CLI (another process): the running server refuses the key from the next request.
        key_id = keys["alice"].split("_")[1]
        cli(capsys, db, data, "keys", "revoke", key_id)
        after, _ = generate(url, keys["alice"], "alice again", 12)
        assert after.status_code == 401 and after.json()["error"]["code"] == "invalid_api_key"
        assert output(url, keys["alice"], alice_sha).status_code == 401
        # Bob's key is untouched by it.
        assert output(url, keys["bob"], bob_sha).status_code == 200


def test_a_studio_without_accounts_keeps_its_one_identity(tmp_path: Path) -> None:
    """No users: the API is open as before (and nothing is recorded with an owner)."""
    with running_server(["serve"], tmp_path / "data") as server:
        reply = httpx.post(
            f"{server.url}/v1/images/generations", json={**GEN, "prompt": "open", "seed": 1}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        png = base64.b64decode(reply.json()["data"][0]["b64_json"])
        sha = hashlib.sha256(png).hexdigest()
        assert httpx.get(f"{server.url}/v1/outputs/{sha}.png", timeout=30).status_code == 200


class FakeEngine:
    config = None

    def position(self, request_id: str) -> None:
        return None


def test_the_queue_shows_each_user_their_own_rows_and_the_admin_all() -> None:
    board = RequestBoard()
    for request_id, owner in (("a1", "user:alice"), ("b1", "user:bob"), ("b2", "user:bob")):
        board.add(request_id, "api", owner, f"prompt {request_id}", FakeEngine())
    view = QueueView(board, None)
    team = [Identity("alice", accounts=True), Identity("bob", accounts=True), Identity("root", True, True)]
    alice, bob, root = (Viewer.of_ui("s", n.name, None, n) for n in team)
    assert [row.id for row in view.rows(alice)] == ["a1"]
    assert sorted(row.id for row in view.rows(bob)) == ["b1", "b2"]
    assert sorted(row.id for row in view.rows(root)) == ["a1", "b1", "b2"]
    assert all(row.yours for row in view.rows(alice)) and not any(
        row.yours for row in view.rows(bob) if row.id == "a1"
    )
    # Alice may not cancel bob's request, even by its id.
    with pytest.raises(Exception, match="Nothing with id b1"):
        view.cancel(alice, "b1")
    # Without accounts every visitor sees every row, as before.
    anyone = Viewer.of_ui("s", None, None, Identity())
    assert len(view.rows(anyone)) == 3


def test_fair_scheduling_counts_a_user_as_one_client_whatever_key_or_address() -> None:
    """Two keys of alice from two addresses are one client; bob is another; without an account the
    address and key stay the client, as before."""
    assert RunService.client_of("127.0.0.1|key-a") == "127.0.0.1|key-a"
    token = act_as(Identity("alice", accounts=True))
    try:
        assert RunService.client_of("127.0.0.1|key-a") == "user:alice"
        assert RunService.client_of("10.0.0.2|key-b") == "user:alice"
    finally:
        stop_acting(token)
    token = act_as(Identity("bob", accounts=True))
    try:
        assert RunService.client_of("127.0.0.1|key-a") == "user:bob"
    finally:
        stop_acting(token)


def test_share_with_accounts_generates_no_login_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture, share_guard
) -> None:
    """`--share` with accounts: no generated login or key; the banner says the accounts log in; an
    account's password logs in to the UI and its key opens the API (the share tunnel is the test's
    refusing stand-in, tests/share_guard.py)."""
    data = tmp_path / "data"
    data.mkdir()
    db = f"sqlite:///{data / 'runs.db'}"
    keys = make_team(capsys, db, data)
    with running_server(["ui", "--share"], data) as server:
        log = server.log()
        assert "logins: the studio's accounts" in log and "no login generated" in log, log
        assert "UI login:" not in log and "API key (required on /v1 when shared)" not in log, log
        login = httpx.post(
            f"{server.url}/login",
            data={"username": "alice", "password": "a long enough password"},
            timeout=30,
        )
        assert login.status_code == 200, login.text
        wrong = httpx.post(
            f"{server.url}/login", data={"username": "alice", "password": "nope nope"}, timeout=30
        )
        assert wrong.status_code == 400
        # Repeating one wrong password is throttled (the login guard, as for wrong API keys); the right
        # password from the same address still works at once.
        statuses = [
            httpx.post(f"{server.url}/login", data={"username": "alice", "password": "nope nope"}, timeout=30)
            for _ in range(5)
        ]
        assert [r.status_code for r in statuses] == [400, 400, 400, 400, 429]
        assert int(statuses[-1].headers["Retry-After"]) > 0
        again = httpx.post(
            f"{server.url}/login",
            data={"username": "alice", "password": "a long enough password"},
            timeout=30,
        )
        assert again.status_code == 200, again.text
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(
            f"{server.url}/v1/models", headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=30
        )
        assert models.status_code == 200
        # Every account removed while it runs: the shared API still needs a key (none was generated).
        for name in ("alice", "bob", "root"):
            cli(capsys, db, data, "users", "remove", name)
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
