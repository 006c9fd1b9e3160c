"""`--share`: a login and an API key are generated and printed, and both are enforced. The test run's share
guard (tests/share_guard.py, docs/testing.md) refuses the tunnel on 127.0.0.1, so Gradio reports that it could
not create the link and the studio keeps serving locally; the first test proves nothing leaves the machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.servers import free_port, running_server

pytestmark = pytest.mark.browser

# Gradio's own share step, in a fresh interpreter with the test run's environment, every name lookup,
# connection and program start recorded (Python's audit hooks see them all, httpx's included).
SHARE_PROBE = """
import json, socket, sys
seen = []
def record(event, args):
    if event == "socket.getaddrinfo":
        seen.append(["resolve", str(args[0])])
    elif event == "socket.connect" and args[0].family in (socket.AF_INET, socket.AF_INET6):
        seen.append(["connect", str(args[1][0])])
    elif event == "subprocess.Popen":
        seen.append(["run", [str(arg) for arg in args[1]]])
sys.addaudithook(record)
from gradio import networking
try:
    url = networking.setup_tunnel("127.0.0.1", int(sys.argv[1]), "probe-token", None, None)
except Exception as error:
    url = None
    seen.append(["refused", repr(error)])
print("PROBE " + json.dumps({"url": url, "seen": seen}), flush=True)
"""


def test_share_guard_refuses_the_tunnel_without_leaving_the_machine(share_guard):
    port = free_port()
    probe = subprocess.run(
        [sys.executable, "-c", SHARE_PROBE, str(port)],
        capture_output=True,
        text=True,
        env={**os.environ},
        check=True,
    )
    lines = [line for line in probe.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, probe.stdout + probe.stderr
    result = json.loads(lines[0].removeprefix("PROBE "))
    assert result["url"] is None, result  # no share link
    seen = result["seen"]
    assert any(kind == "refused" and "share guard" in what for kind, what in seen), seen
    runs = [what for kind, what in seen if kind == "run"]
    # the stand-in client ran (nothing was downloaded), pointed at the guard's refusing 127.0.0.1 port
    assert [run[0] for run in runs] == [str(share_guard.client)], runs
    argv = runs[0]
    assert argv[argv.index("-l") + 1] == str(port)
    assert argv[argv.index("--server_addr") + 1] == share_guard.address
    assert any(call[call.index("-l") + 1] == str(port) for call in share_guard.calls())
    # no name was looked up and nothing was connected to outside this machine (api.gradio.app, the CDN)
    remote = [
        (kind, what)
        for kind, what in seen
        if kind in ("resolve", "connect") and what not in ("127.0.0.1", "localhost", "::1")
    ]
    assert remote == [], remote
    # and the guard's port refuses a connection, whatever client tries it
    host, guard_port = share_guard.address.split(":")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{host}:{guard_port}/", timeout=5)


def test_share_without_auth_generates_credentials_and_protects_the_api(tmp_path, share_guard):
    with running_server(["ui", "--share"], tmp_path / "data", ready_path="/health") as server:
        log = server.log()
        # the studio's share step went to the guard (tests/share_guard.py) and it said so
        assert any(call[call.index("-l") + 1] == str(server.port) for call in share_guard.calls())
        assert "share link: not available" in log, log
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
