"""`--share`: a login and an API key are generated and printed, and both are enforced (no internet here,
so Gradio reports that it could not create the link and the studio keeps serving locally)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.servers import running_server

pytestmark = pytest.mark.browser


def test_share_without_auth_generates_credentials_and_protects_the_api(tmp_path):
    with running_server(["ui", "--share"], tmp_path / "data", ready_path="/health") as server:
        log = server.log()
        login = re.search(r"UI login: (\S+) / (\S+)", log)
        key = re.search(r"API key \(required on /v1 when shared\): (\S+)", log)
        assert login and key, log
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert (
            httpx.get(
                server.url + "/v1/models", headers={"Authorization": f"Bearer {key.group(1)}"}
            ).status_code
            == 200
        )
        # the UI itself asks for the login
        assert httpx.get(server.url + "/config").status_code == 401
        session = httpx.Client(base_url=server.url)
        response = session.post("/login", data={"username": login.group(1), "password": login.group(2)})
        assert response.status_code == 200
        assert session.get("/config").status_code == 200


def test_explicit_auth_and_key_are_used_as_given(tmp_path):
    args = ["ui", "--share", "--auth", "alice:s3cret", "--api-key", "k-given"]
    with running_server(args, tmp_path / "data") as server:
        log = server.log()
        assert "UI login: alice / s3cret" in log and "API key (required" not in log
        assert (
            httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k-given"}).status_code
            == 200
        )
