"""A team studio's Compare and Replay keep to each user's own runs (docs/team.md, "Isolation"): through a
live `omni-studio ui` with accounts, called as Gradio's API with each user's login (gradio_client), bob
cannot compare or replay alice's run (it answers as if the run did not exist) and can his own; the admin
can compare anyone's."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gradio_client import Client

from studio.cli import main
from tests.servers import running_server

PASSWORD = "a long enough password"
GEN = {"model": "tiny-glm-image", "height": 64, "width": 64, "num_inference_steps": 2}


def _cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str]]]:
    """The live studio and each user's run id (alice's, bob's: one image each through their own key)."""
    data = tmp_path_factory.mktemp("team-ui") / "data"
    data.mkdir()
    password = data.parent / "pw"
    password.write_text(PASSWORD + "\n")
    keys = {}
    for name, admin in (("alice", []), ("bob", []), ("root", ["--admin"])):
        _cli("users", "add", name, *admin, "--password-file", str(password), "--data-dir", str(data))
        keys[name] = _cli("keys", "create", "--user", name, "--data-dir", str(data)).splitlines()[-1]
    with running_server(["ui"], data) as server:
        runs = {}
        for seed, name in enumerate(("alice", "bob")):
            reply = httpx.post(
                f"{server.url}/v1/images/generations",
                json={**GEN, "prompt": f"a circle for {name}", "seed": seed},
                headers={"Authorization": f"Bearer {keys[name]}"},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            runs[name] = reply.headers["X-Run-Id"]
        yield server, runs


def _as(server: Any, name: str) -> Client:
    return Client(server.url + "/", auth=(name, PASSWORD), verbose=False)


def test_a_user_compares_their_own_runs_only_and_the_admin_anyones(team: tuple[Any, dict[str, str]]) -> None:
    server, runs = team
    bob = _as(server, "bob")
    with pytest.raises(Exception, match=f"no run id starts with '{runs['alice'][:8]}'"):
        bob.predict(runs["alice"][:8], runs["bob"], api_name="/compare")
    table = bob.predict(runs["bob"], runs["bob"], api_name="/compare")[0]
    assert table is not None  # his own run compares (with itself)
    admin = _as(server, "root")
    assert admin.predict(runs["alice"], runs["bob"], api_name="/compare")[0] is not None


def test_a_user_cannot_replay_another_users_run(team: tuple[Any, dict[str, str]]) -> None:
    server, runs = team
    bob = _as(server, "bob")
    blank = {"search_v": "", "fingerprint_v": "", "config_v": "", "since_v": "", "until_v": ""}
    with pytest.raises(Exception, match=f"no run with id '{runs['alice']}'"):
        bob.predict(run_id_v=runs["alice"], **blank, api_name="/replay")
    # The runs matching the filters, for bob: his own only (the report names his run, not alice's).
    report = bob.predict(run_id_v="", scope_v="the runs matching the filters", **blank, api_name="/replay")[0]
    assert runs["bob"][:8] in report and runs["alice"][:8] not in report
